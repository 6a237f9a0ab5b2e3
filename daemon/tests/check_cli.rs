//! `kvaffined check` against emulated replicas: a real process, real HTTP.

use std::process::Command;

use vllm_emu::harness::EmuProcess;

fn check(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvaffined"))
        .arg("check")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn a_sha256_cbor_replica_passes_and_a_pickle_one_fails() {
    let good = EmuProcess::start(&["--block-size", "64"]);
    let (code, text) = check(&["--endpoint", &good.http, "--block-size", "64"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("sha256_cbor") && text.contains(&good.events),
        "{text}"
    );
    let (code, text) = check(&["--endpoint", &good.http, "--block-size", "16"]);
    assert_eq!(code, Some(2), "{text}");
    let pickle = EmuProcess::start(&["--engine-hash", "opaque"]);
    let (code, text) = check(&["--endpoint", &format!("http://{}", pickle.http)]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("--prefix-caching-hash-algo sha256_cbor"),
        "{text}"
    );
    let (code, _) = check(&["--endpoint", "127.0.0.1:1"]);
    assert_eq!(code, Some(2));
}
