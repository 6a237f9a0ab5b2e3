//! Client routing headers never reach the router: the filter strips what only it may set,
//! in the compiled module, whatever the request.

use kvaffine_wasm_host::filter_wasm;
use kvaffine_wasm_host::vm::{Action, Headers, Vm};

/// In Envoy mode the filter strips what only it may set, on every request: the pinned
/// endpoint, the model header, and the per-try timeout (Envoy drops `x-envoy-*` headers of
/// requests it does not count as internal; a gateway that trusts its clients would honour a
/// client's, and only the filter's own bound for streams may be set).
#[test]
fn client_routing_headers_are_stripped_in_envoy_mode() {
    let config = br#"{"tokenizer_cluster": "tokenizer", "index_cluster": "kvaffined",
        "block_size": 16}"#;
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", config).expect("the filter loads");
    let spoofed = [
        "x-gateway-destination-endpoint",
        "x-kvaffine-model",
        "x-envoy-upstream-rq-per-try-timeout-ms",
    ];
    let mut headers: Headers = vec![
        (":method".into(), b"GET".to_vec()),
        (":path".into(), b"/v1/models".to_vec()),
        (":authority".into(), b"gateway".to_vec()),
    ];
    headers.extend(spoofed.iter().map(|name| (name.to_string(), b"1".to_vec())));
    let stream = vm.open_stream(headers, None).expect("a stream");
    assert_eq!(vm.on_request_headers(stream), Some(Action::Continue));
    let left = &vm.stream_state(stream).expect("the stream").request_headers;
    for name in spoofed {
        assert!(
            left.iter().all(|(n, _)| n != name),
            "{name} left in {left:?}"
        );
    }
}
