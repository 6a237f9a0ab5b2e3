//! Any request body, for every API and mode: planning returns (never panics), a rebuilt
//! tokenize body is JSON, and the token-list scan agrees with serde wherever both read one.
#![no_main]

use kvaffine_core::api::Api;
use kvaffine_core::config::{Mode, Router};
use kvaffine_core::plan::{self, Action};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(router) = Router::from_json(br#"{"block_size":4}"#) else {
        return;
    };
    for api in [Api::ChatCompletions, Api::Completions, Api::Responses] {
        for mode in [Mode::Precise, Mode::Approximate, Mode::Load] {
            let plan = plan::plan(&router, api, mode, data);
            if let Action::Tokenize { body, .. } = &plan.action {
                if body.as_slice() != data {
                    assert!(serde_json::from_slice::<serde_json::Value>(body).is_ok());
                }
            }
            let _ = plan::approximate_fallback(&router, api, data, &plan);
        }
    }
    let scanned = kvaffine_core::tokens::token_list(data);
    #[derive(serde::Deserialize)]
    struct Answer {
        tokens: Vec<u32>,
    }
    if let (Some(scanned), Ok(parsed)) = (scanned, serde_json::from_slice::<Answer>(data)) {
        assert_eq!(scanned, parsed.tokens);
    }
});
