//! `kvaffined keys` as an operator runs it: a real process, stdin in, JSON or one error
//! line out. Expected hashes come from `../shared/vectors/block_hashes.json`.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

fn keys(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvaffined"))
        .arg("keys")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A command that rejects its flags exits without reading stdin: a broken pipe is an
    // expected outcome of that race, any other write error is not.
    if let Err(err) = child.stdin.take().unwrap().write_all(stdin.as_bytes()) {
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe, "{err}");
    }
    child.wait_with_output().unwrap()
}

fn vectors() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/vectors/block_hashes.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("golden vectors {} are required: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn case<'a>(data: &'a Value, id: &str) -> &'a Value {
    data["versions"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|v| v["cases"].as_array().unwrap())
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no vector case {id}"))
}

fn assert_prints_case(args: &[&str], data: &Value, id: &str) {
    let case = case(data, id);
    let tokens = &data["sequences"][case["sequence"].as_str().unwrap()];
    let out = keys(args, &tokens.to_string());
    assert!(
        out.status.success(),
        "{id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let want: Vec<(String, u64)> = case["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["hash_hex"].as_str().unwrap().to_owned(),
                b["event_block_hash_int"].as_u64().unwrap(),
            )
        })
        .collect();
    let got: Vec<(String, u64)> = printed["hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["full"].as_str().unwrap().to_owned(),
                h["event"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(!want.is_empty(), "{id} has blocks");
    assert_eq!(got, want, "{id}");
}

#[test]
fn prints_vllm_keys_for_salted_lora_and_seeded_requests() {
    let data = vectors();
    assert_prints_case(
        &[
            "--block-size",
            "16",
            "--cache-salt",
            "tenant-a",
            "--lora-name",
            "sql-lora",
            "--lora-path",
            "/adapters/sql-lora",
        ],
        &data,
        "0.33.0/sha256_cbor/seed=None/bs=16/mixed_99/salt=tenant-a/lora",
    );
    assert_prints_case(
        &[
            "--block-size",
            "16",
            "--cache-salt",
            "tenant-a",
            "--lora-name",
            "sql-lora",
            "--lora-path",
            "/adapters/sql-lora",
            "--vllm-compat",
            "0.30",
        ],
        &data,
        "0.30.0/sha256_cbor/seed=None/bs=16/mixed_99/salt=tenant-a/lora",
    );
    assert_prints_case(
        &[
            "--block-size",
            "64",
            "--hash-algo",
            "xxhash_cbor",
            "--hash-seed",
            "0",
        ],
        &data,
        "0.33.0/xxhash_cbor/seed=0/bs=64/len_200/salt=None",
    );
}

#[test]
fn bad_input_exits_2_with_one_line() {
    let cases: &[(&[&str], &str, &str)] = &[
        (&["--block-size", "4"], "not json", "not JSON"),
        (&["--block-size", "4"], "[1, -1]", "negative"),
        (&["--block-size", "4"], "[1, 2.5]", "not an integer"),
        (
            &["--block-size", "4", "--cache-salt", ""],
            "[1]",
            "non-empty",
        ),
        (&["--block-size", "4", "--cache-salt", "a/b"], "[1]", "'/'"),
        (&["--block-size", "4", "--cache-salt", "a@b"], "[1]", "'@'"),
        (
            &["--block-size", "4", "--cache-salt", "a\\b"],
            "[1]",
            "'\\\\'",
        ),
        (
            &["--block-size", "4", "--cache-salt", &"s".repeat(129)],
            "[1]",
            "at most 128",
        ),
        (
            &["--block-size", "4", "--hash-algo", "xxhash_cbor"],
            "[1]",
            "needs a hash seed",
        ),
    ];
    for (args, stdin, why) in cases {
        let out = keys(args, stdin);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(why), "{args:?}: {stderr}");
    }
}

#[test]
fn random_stdin_gets_keys_or_exit_2_never_a_crash() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let pieces = [
        "[",
        "]",
        ",",
        "1",
        "-1",
        "4294967296",
        "1.5",
        "\"x\"",
        "null",
        "{}",
        " ",
        "99",
        "\u{0}",
        "\u{ff}",
    ];
    for _ in 0..200 {
        let input: String = (0..next() % 12)
            .map(|_| pieces[(next() as usize) % pieces.len()])
            .collect();
        let out = keys(&["--block-size", "2"], &input);
        match out.status.code() {
            Some(0) => {
                let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
                assert!(printed["hashes"].is_array(), "{input:?}");
            }
            Some(2) => assert_eq!(
                String::from_utf8_lossy(&out.stderr).lines().count(),
                1,
                "{input:?}"
            ),
            other => panic!("{input:?}: exit {other:?}"),
        }
    }
}
