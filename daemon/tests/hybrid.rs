//! `kvaffined serve` following a hybrid-attention replica over real ZMQ: events shaped as
//! vLLM 0.32 publishes them for a tiny Gemma 3 (a sliding-window group 0 whose stores list
//! only the blocks it keeps, published before the full-attention group 1 of the same step;
//! a hybrid miss storing the prefix again), and the hits the daemon answers.

mod common;

use common::*;
use kvaffine_core::Digest;
use kvaffine_core::events::{BlockRemoved, BlockStored, EngineHash, KvEvent};
use serde_json::json;
use vllm_emu::publisher::{EventPublisher, PublisherConfig};

const A: &str = "127.0.0.1:1";
/// A 64-token window over blocks of 16: a hit needs the 4 blocks before it.
const WINDOW: i64 = 64;

fn own(d: &Digest) -> u64 {
    d.block_key().0
}

/// The full-attention store of `tokens[from_block..]`.
fn full(tokens: &[u32], from_block: usize, hash: fn(&Digest) -> u64) -> KvEvent {
    let mut event = stored(tokens, from_block, hash);
    if let KvEvent::BlockStored(s) = &mut event {
        s.group_idx = Some(1);
    }
    event
}

/// The sliding-window store of the same range: every token, but the hashes of the `kept`
/// blocks only.
fn window(
    tokens: &[u32],
    from_block: usize,
    kept: std::ops::Range<usize>,
    hash: fn(&Digest) -> u64,
) -> KvEvent {
    let all = digests(tokens);
    let KvEvent::BlockStored(whole) = stored(tokens, from_block, hash) else {
        unreachable!()
    };
    KvEvent::BlockStored(BlockStored {
        block_hashes: all[kept].iter().map(|d| EngineHash::Int(hash(d))).collect(),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("sliding_window".into()),
        kv_cache_spec_sliding_window: Some(WINDOW),
        ..whole
    })
}

fn removed_from(
    group: i64,
    tokens: &[u32],
    blocks: std::ops::Range<usize>,
    hash: fn(&Digest) -> u64,
) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: digests(tokens)[blocks]
            .iter()
            .map(|d| EngineHash::Int(hash(d)))
            .collect(),
        medium: Some("GPU".into()),
        group_idx: Some(group),
        ..BlockRemoved::default()
    })
}

/// One engine step's stores of `tokens[from_block..]`: the window group's (keeping the
/// `kept` blocks) first, then full attention's, in one batch, as vLLM publishes them.
fn step(
    p: &EventPublisher,
    tokens: &[u32],
    from_block: usize,
    kept: std::ops::Range<usize>,
    hash: fn(&Digest) -> u64,
) {
    p.publish(&batch(vec![
        window(tokens, from_block, kept, hash),
        full(tokens, from_block, hash),
    ]))
    .unwrap();
}

/// `base`'s first `shared` blocks, then blocks of its own.
fn branch(base: &[u32], shared: usize, seed: u32, blocks: usize) -> Vec<u32> {
    let mut tokens = base[..shared * BLOCK_SIZE].to_vec();
    tokens.extend(prompt(seed, blocks - shared));
    tokens
}

/// A daemon following one publisher.
fn follow() -> (EventPublisher, DaemonProcess) {
    let ctx = zmq::Context::new();
    let p = EventPublisher::start(&ctx, PublisherConfig::default()).unwrap();
    let flag = format!("{A}={},{}", p.endpoint(), p.replay_endpoint().unwrap());
    let daemon = DaemonProcess::start(&["--endpoint", &flag]);
    daemon.wait_ready();
    (p, daemon)
}

/// Branching siblings, duplicate copies and window evictions, as vLLM serves them.
fn hits_follow_vllms_hybrid_rule(hash: fn(&Digest) -> u64) {
    let (p, daemon) = follow();
    let a = prompt(1, 12);
    // Turn A: a miss; vLLM keeps the window ending at the prompt's end.
    step(&p, &a, 0, 8..12, hash);
    wait_for("A's blocks", || daemon.matched(&keys(&a), A) == 12);
    let status = daemon.endpoint_status(A);
    assert_eq!(
        status["kv_cache_groups"],
        json!([
            {"group": 0, "kind": "sliding_window", "sliding_window": WINDOW, "block_size": BLOCK_SIZE},
            {"group": 1, "kind": "full_attention", "sliding_window": null, "block_size": BLOCK_SIZE},
        ])
    );
    assert_eq!(status["kv_cache_unsupported"], json!(null));
    // A sibling branching at block 10: full attention holds 10 blocks, but no window ends
    // there, so vLLM serves nothing.
    let b = branch(&a, 10, 2, 14);
    assert_eq!(daemon.matched(&keys(&b), A), 0);
    // vLLM recomputes B from block 0: its full-attention group stores the shared prefix
    // again, and its window group keeps the window before the junction and the end.
    step(&p, &b, 0, 6..14, hash);
    wait_for("B's blocks", || daemon.matched(&keys(&b), A) == 14);
    let c = branch(&a, 10, 3, 13);
    assert_eq!(
        daemon.matched(&keys(&c), A),
        10,
        "served up to the junction"
    );
    // One of the two full-attention copies of block 5 goes: the other still serves.
    p.publish(&batch(vec![removed_from(1, &a, 5..6, hash)]))
        .unwrap();
    p.publish(&batch(vec![removed_from(0, &b, 7..8, hash)]))
        .unwrap();
    // The window before the junction lost block 7: nothing is served below block 10, and
    // the lookup walks back past the hole to find no other window.
    wait_for("the window eviction", || daemon.matched(&keys(&c), A) == 0);
    assert_eq!(daemon.matched(&keys(&a), A), 12, "A's end window stands");
    // The last full-attention copy of block 5 goes: A is served no further than block 5,
    // where no window ends.
    p.publish(&batch(vec![removed_from(1, &b, 5..6, hash)]))
        .unwrap();
    wait_for("the last copy", || daemon.matched(&keys(&a), A) == 0);
    assert_eq!(
        daemon.metric("kvaffined_rekey_orphans_total{endpoint=\"127.0.0.1:1\"}"),
        0.0
    );
}

#[test]
fn aligned_hybrid_hits_follow_vllms_rule() {
    hits_follow_vllms_hybrid_rule(own);
}

#[test]
fn rekeyed_hybrid_hits_follow_vllms_rule() {
    hits_follow_vllms_hybrid_rule(opaque);
}

/// A window eviction on a re-keyed replica leaves the block known to the full-attention
/// group, so a continuation chained from it is still translated.
#[test]
fn a_window_eviction_does_not_orphan_a_rekeyed_continuation() {
    let (p, daemon) = follow();
    let a = prompt(4, 8);
    step(&p, &a, 0, 4..8, opaque);
    wait_for("A's blocks", || daemon.matched(&keys(&a), A) == 8);
    p.publish(&batch(vec![removed_from(0, &a, 7..8, opaque)]))
        .unwrap();
    let mut longer = a.clone();
    longer.extend(prompt(5, 4));
    step(&p, &longer, 8, 8..12, opaque);
    wait_for("the continuation", || {
        daemon.matched(&keys(&longer), A) == 12
    });
    assert_eq!(
        daemon.metric("kvaffined_rekey_orphans_total{endpoint=\"127.0.0.1:1\"}"),
        0.0
    );
    assert_eq!(daemon.endpoint_status(A)["alignment"], "rekeyed");
}

/// A booking on a hybrid replica credits what vLLM will keep: the full-attention prefix,
/// and the window only at the request's end.
#[test]
fn a_hybrid_booking_credits_only_the_window_its_request_leaves() {
    let (p, daemon) = follow();
    // The replica's groups are learned from its first store.
    let seen = prompt(6, 4);
    step(&p, &seen, 0, 0..4, own);
    wait_for("the groups", || daemon.matched(&keys(&seen), A) == 4);
    let d = prompt(7, 12);
    let body = json!({"keys": keys(&d), "book": {"ttl_ms": 60_000}}).to_string();
    assert_eq!(daemon.json("POST", "/v1/lookup", &body).1["booked"], A);
    assert_eq!(daemon.matched(&keys(&d), A), 12, "the same prompt again");
    let sibling = branch(&d, 8, 8, 12);
    assert_eq!(
        daemon.matched(&keys(&sibling), A),
        0,
        "no window ends where the sibling branches"
    );
    // The sibling's own booking keeps the junction for the next one.
    let body = json!({"keys": keys(&sibling), "book": {"ttl_ms": 60_000}}).to_string();
    daemon.json("POST", "/v1/lookup", &body);
    let third = branch(&d, 8, 9, 11);
    assert_eq!(daemon.matched(&keys(&third), A), 8);
}

/// Groups kvaffine cannot follow are said, and predict no hit.
#[test]
fn an_unknown_group_kind_is_unsupported_and_predicts_nothing() {
    let (p, daemon) = follow();
    let a = prompt(10, 4);
    let KvEvent::BlockStored(mamba) = full(&a, 0, own) else {
        unreachable!()
    };
    let mamba = KvEvent::BlockStored(BlockStored {
        group_idx: Some(0),
        kv_cache_spec_kind: Some("mamba".into()),
        ..mamba
    });
    p.publish(&batch(vec![mamba, full(&a, 0, own)])).unwrap();
    wait_for("the groups", || {
        daemon.endpoint_status(A)["kv_cache_unsupported"].is_string()
    });
    let why = daemon.endpoint_status(A)["kv_cache_unsupported"].clone();
    assert!(why.as_str().unwrap().contains("mamba"), "{why}");
    assert_eq!(daemon.matched(&keys(&a), A), 0);
    assert_eq!(
        daemon.metric("kvaffined_endpoint_kv_cache_unsupported{endpoint=\"127.0.0.1:1\"}"),
        1.0
    );
}
