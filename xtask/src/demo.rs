//! `cargo xtask demo`: what kvaffine computes for a two-turn conversation, through the
//! real `kvaffined` binary. It grows into the full stack (replicas, daemon, Envoy) as those
//! parts land.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::sh;

const BLOCK_SIZE: &str = "16";

fn keys(tokens: &[u32], salt: Option<&str>) -> anyhow::Result<Vec<u64>> {
    let binary = sh::root().join("target/debug/kvaffined");
    let mut command = Command::new(&binary);
    command.args(["keys", "--block-size", BLOCK_SIZE]);
    if let Some(salt) = salt {
        command.args(["--cache-salt", salt]);
    }
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", binary.display()))?;
    child
        .stdin
        .take()
        .context("no stdin")?
        .write_all(serde_json::to_string(tokens)?.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("kvaffined keys failed: {}", out.status);
    }
    let printed: Value = serde_json::from_slice(&out.stdout)?;
    printed["hashes"]
        .as_array()
        .context("no hashes")?
        .iter()
        .map(|h| h["event"].as_u64().context("no event key"))
        .collect()
}

fn shared_prefix(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Prints the keys of a conversation's two turns, and of the same turn under another salt.
pub fn run() -> anyhow::Result<()> {
    sh::cargo(&["build", "--quiet", "-p", "kvaffined"])?;
    let turn1: Vec<u32> = (0..70).map(|i| (i * 7919) % 151_936).collect();
    let mut turn2 = turn1.clone();
    turn2.extend((0..60).map(|i| (i * 104_729) % 151_936));
    let k1 = keys(&turn1, Some("tenant-a"))?;
    let k2 = keys(&turn2, Some("tenant-a"))?;
    let other = keys(&turn2, Some("tenant-b"))?;
    println!("block size {BLOCK_SIZE}, sha256_cbor, vLLM >= 0.31 keys");
    println!(
        "turn 1: {} tokens -> {} block keys (first {})",
        turn1.len(),
        k1.len(),
        k1.first().copied().unwrap_or_default()
    );
    println!(
        "turn 2: {} tokens -> {} block keys, {} shared with turn 1: the replica holding turn 1 serves them from cache",
        turn2.len(),
        k2.len(),
        shared_prefix(&k1, &k2)
    );
    println!(
        "turn 2 under another cache_salt: {} of {} keys shared: tenants never share cache or affinity",
        shared_prefix(&k2, &other),
        k2.len()
    );
    Ok(())
}
