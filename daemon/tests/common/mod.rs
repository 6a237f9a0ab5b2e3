//! A real `kvaffined serve` process for integration tests, and the helpers they share:
//! vLLM-shaped events built from core's keys, a minimal HTTP client, polling with a
//! deadline instead of sleeps.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code, unused_imports)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use kvaffine_core::events::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use kvaffine_core::{Digest, HashAlgo, KeyConfig, KeyExtras, VllmCompat};
use serde_json::Value;
pub use vllm_emu::harness::{EmuProcess, http, wait_for};

pub const BLOCK_SIZE: usize = 16;

pub fn keys_config() -> KeyConfig {
    KeyConfig::new(HashAlgo::Sha256Cbor, BLOCK_SIZE, None, VllmCompat::V0_31).unwrap()
}

/// Tokens of a prompt, distinct per `seed`.
pub fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK_SIZE) as u32)
        .map(|i| (seed.wrapping_mul(7919) + i * 104_729) % 151_936)
        .collect()
}

pub fn digests(tokens: &[u32]) -> Vec<Digest> {
    keys_config().digests(&KeyExtras::default(), tokens)
}

pub fn keys(tokens: &[u32]) -> Vec<u64> {
    digests(tokens).iter().map(|d| d.block_key().0).collect()
}

/// A stand-in for vLLM's unreproducible pickle hash: some other deterministic function.
pub fn opaque(digest: &Digest) -> u64 {
    digest.block_key().0.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef
}

/// A BlockStored for `tokens[from_block..]` as vLLM publishes it, hashes mapped by `hash`.
pub fn stored(tokens: &[u32], from_block: usize, hash: fn(&Digest) -> u64) -> KvEvent {
    let all = digests(tokens);
    let new = &all[from_block..];
    KvEvent::BlockStored(BlockStored {
        block_hashes: new.iter().map(|d| EngineHash::Int(hash(d))).collect(),
        parent_block_hash: from_block
            .checked_sub(1)
            .map(|p| EngineHash::Int(hash(&all[p]))),
        token_ids: tokens
            [from_block * BLOCK_SIZE..new.len() * BLOCK_SIZE + from_block * BLOCK_SIZE]
            .to_vec(),
        block_size: BLOCK_SIZE as u64,
        medium: Some("GPU".into()),
        extra_keys: Some(vec![None; new.len()]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        ..BlockStored::default()
    })
}

pub fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| EngineHash::Int(*h)).collect(),
        medium: Some("GPU".into()),
        group_idx: Some(0),
        ..BlockRemoved::default()
    })
}

pub fn batch(events: Vec<KvEvent>) -> EventBatch {
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    EventBatch {
        ts,
        events,
        data_parallel_rank: Some(0),
        skipped_unknown: 0,
    }
}

/// A running `kvaffined serve`, killed on drop.
pub struct DaemonProcess {
    child: Child,
    pub addr: String,
}

impl DaemonProcess {
    pub fn start(args: &[&str]) -> Self {
        Self::spawn(Command::new(env!("CARGO_BIN_EXE_kvaffined")), args)
    }

    /// Started with a soft limit of `soft` open files, as many hosts start processes
    /// (util-linux's `prlimit` sets it for the child alone).
    pub fn start_with_open_files(soft: u64, args: &[&str]) -> Self {
        let mut command = Command::new("prlimit");
        command
            .arg(format!("--nofile={soft}:"))
            .arg(env!("CARGO_BIN_EXE_kvaffined"));
        Self::spawn(command, args)
    }

    fn spawn(mut command: Command, args: &[&str]) -> Self {
        let mut child = command
            .arg("serve")
            .args([
                "--listen",
                "127.0.0.1:0",
                "--block-size",
                &BLOCK_SIZE.to_string(),
            ])
            .args(args)
            .env("RUST_LOG", "kvaffined=debug,info")
            .stdout(Stdio::piped())
            // KVAFFINE_TEST_LOGS=1 shows the daemon's logs while debugging a test.
            .stderr(if std::env::var_os("KVAFFINE_TEST_LOGS").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        Self { child, addr }
    }

    pub fn request(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        http(&self.addr, method, path, body)
    }

    pub fn json(&self, method: &str, path: &str, body: &str) -> (u16, Value) {
        let (status, text) = self.request(method, path, body);
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub fn lookup(&self, keys: &[u64]) -> Value {
        let body = serde_json::json!({ "keys": keys }).to_string();
        let (status, value) = self.json("POST", "/v1/lookup", &body);
        assert_eq!(status, 200, "{value}");
        value
    }

    /// `matched_blocks` of `endpoint` for `keys`.
    pub fn matched(&self, keys: &[u64], endpoint: &str) -> u64 {
        let answer = self.lookup(keys);
        answer["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == endpoint)
            .unwrap_or_else(|| panic!("{endpoint} not in {answer}"))["matched_blocks"]
            .as_u64()
            .unwrap()
    }

    /// `endpoint`'s record in a protocol-1 lookup `answer`.
    pub fn record(answer: &Value, endpoint: &str) -> Value {
        answer["endpoints"]
            .as_array()
            .and_then(|all| all.iter().find(|e| e["endpoint"] == endpoint))
            .cloned()
            .unwrap_or_else(|| panic!("{endpoint} not in {answer}"))
    }

    pub fn endpoint_status(&self, endpoint: &str) -> Value {
        let (_, value) = self.json("GET", "/v1/endpoints", "");
        value["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == endpoint)
            .unwrap_or_else(|| panic!("{endpoint} not in {value}"))["status"]
            .clone()
    }

    /// The value of a series in `/metrics` (0 when absent).
    pub fn metric(&self, series: &str) -> f64 {
        let (_, text) = self.request("GET", "/metrics", "");
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    }

    /// The process's resident set, in KiB.
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }

    pub fn wait_ready(&self) {
        wait_for("daemon ready", || {
            self.request("GET", "/readyz", "").0 == 200
        });
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
