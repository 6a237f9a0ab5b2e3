//! The filter's digest-cache key comes from the host's random source: a host whose
//! `random_get` fails gets its configuration refused, with the reason logged.

use kvaffine_wasm_host::filter_wasm;
use kvaffine_wasm_host::vm::{RandomSource, Vm};

const CONFIG: &[u8] =
    br#"{"tokenizer_cluster": "127.0.0.1:1", "index_cluster": "127.0.0.1:2", "block_size": 16}"#;

#[test]
fn a_broken_random_source_refuses_the_configuration() {
    let wasm = filter_wasm();
    let refusal = Vm::load_with(&wasm, "kvaffine", CONFIG, RandomSource::Broken)
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(
        refusal.contains("random_get"),
        "the filter started without randomness, or said nothing of it: {refusal:?}"
    );
    assert!(Vm::load_with(&wasm, "kvaffine", CONFIG, RandomSource::Working).is_ok());
}
