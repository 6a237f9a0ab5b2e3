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
