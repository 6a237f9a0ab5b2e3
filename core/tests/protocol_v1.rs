//! A daemon of protocol 1 (the release before protocol 2) still answers in a form this
//! filter reads, and this filter's fallback still sends what such a daemon reads: the bytes
//! under `tests/wire/v1/` were written by that release's own code.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use kvaffine_core::protocol::{Pick, Query, v1};
use kvaffine_core::{BlockKey, Reason};

fn wire(name: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/wire/v1")
            .join(name),
    )
    .unwrap()
}

#[test]
fn a_protocol_1_daemons_answers_become_picks() {
    let prefix = v1::read_answer(&wire("answer-prefix.json")).unwrap();
    let pick = Pick::from_answer(&prefix, 1).unwrap();
    assert_eq!(pick.header_value(), "127.0.0.1:8001,127.0.0.1:8000");
    assert_eq!((pick.matched_blocks, pick.reason), (3, Reason::Prefix));
    assert_eq!(prefix.booked.as_deref(), Some("127.0.0.1:8001"));
    let load = v1::read_answer(&wire("answer-load.json")).unwrap();
    let pick = Pick::from_answer(&load, 0).unwrap();
    assert_eq!((pick.endpoints.len(), pick.reason), (1, Reason::Load));
}

#[test]
fn protocol_1_requests_are_what_this_fallback_sends() {
    for name in [
        "request-precise.json",
        "request-approximate.json",
        "request-load.json",
    ] {
        let released: serde_json::Value = serde_json::from_slice(&wire(name)).unwrap();
        let request: v1::Request = serde_json::from_value(released.clone()).unwrap();
        let current = request.clone().into_current();
        let resent: serde_json::Value =
            serde_json::from_slice(&v1::Request::from(&current).to_json()).unwrap();
        assert_eq!(resent, released, "{name}");
    }
    let precise: v1::Request = serde_json::from_slice(&wire("request-precise.json")).unwrap();
    assert_eq!(
        precise.into_current().query,
        Query::Blocks([11, 22, 33, 44].map(BlockKey).to_vec())
    );
}
