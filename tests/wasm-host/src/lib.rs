//! A small proxy-wasm host on wasmtime that behaves as Kong (ngx_wasm_module) does for
//! the calls kvaffine's filter makes: callouts to `host:port` (failures reported through
//! `:dispatch_status`), the upstream pinned through the `kong.service.target` property,
//! no route cache (`clear_route_cache` is unknown), no route metadata,
//! `end_of_stream = false` in the headers callback, bodies larger than
//! `client_body_buffer_size` invisible to the filter, and the request resumed once every
//! callout has been answered. No Kong binary installs here; this host is how the Kong mode
//! is tested, and it runs the compiled filter without Envoy in about a millisecond a
//! request.

pub mod gateway;
pub mod vm;

/// The filter module `cargo xtask test` builds; a test fails, with how to build it, when it
/// is missing.
pub fn filter_wasm() -> std::path::PathBuf {
    let wasm = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/wasm32-wasip1/wasm/kvaffine_filter.wasm");
    assert!(
        wasm.exists(),
        "{} is not built: run `cargo xtask test`",
        wasm.display()
    );
    wasm
}

/// Opens a POST of `body` to `path` and runs it to its first callout: the stream, paused
/// on that callout.
pub fn open_post(vm: &mut vm::Vm, path: &str, body: Vec<u8>) -> u32 {
    let headers: vm::Headers = vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), path.as_bytes().to_vec()),
        (":authority".into(), b"gateway".to_vec()),
        ("content-length".into(), body.len().to_string().into_bytes()),
    ];
    let size = body.len();
    let stream = vm.open_stream(headers, Some(body)).expect("a stream");
    assert_eq!(vm.on_request_headers(stream), Some(vm::Action::Pause));
    assert_eq!(vm.on_request_body(stream, size), Some(vm::Action::Pause));
    stream
}

/// Opens a completions request whose prompt is 33 token ids (two full 16-token blocks, no
/// tokenizer call) and runs it to its lookup: the stream, paused on that callout.
pub fn open_token_prompt(vm: &mut vm::Vm) -> u32 {
    let body = br#"{"model":"tiny","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33]}"#.to_vec();
    open_post(vm, "/v1/completions", body)
}

/// The one callout in flight, taken from the host.
pub fn one_call(vm: &mut vm::Vm) -> vm::CallRequest {
    let mut calls = vm.take_calls();
    assert_eq!(calls.len(), 1, "one callout in flight: {calls:?}");
    calls.remove(0)
}

/// The upstream a resumed Kong-mode stream was pinned to.
pub fn kong_target(vm: &vm::Vm, stream: u32) -> Option<String> {
    let state = vm.stream_state(stream)?;
    assert!(state.resumed, "the request was resumed");
    state
        .properties
        .get("kong.service.target")
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// The `x-kvaffine-reason` the filter sets on a 200 answer to `stream`.
pub fn reason(vm: &mut vm::Vm, stream: u32) -> Option<String> {
    let headers = vm
        .on_response_headers(stream, vec![(":status".into(), b"200".to_vec())])
        .expect("response headers");
    headers
        .iter()
        .find(|(name, _)| name == "x-kvaffine-reason")
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
}
