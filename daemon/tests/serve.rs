//! `kvaffined serve` against real ZMQ publishers (vllm-emu's, which behaves as vLLM's
//! `ZmqEventPublisher`) over loopback, and its real HTTP API.

mod common;

use common::*;
use kvaffine_core::Digest;
use kvaffine_core::events::EventFormat;
use serde_json::json;
use vllm_emu::publisher::{EventPublisher, PublisherConfig};

const A: &str = "127.0.0.1:1";
const B: &str = "127.0.0.1:2";

fn publisher(ctx: &zmq::Context) -> EventPublisher {
    EventPublisher::start(ctx, PublisherConfig::default()).unwrap()
}

fn endpoint_flag(name: &str, p: &EventPublisher) -> String {
    match p.replay_endpoint() {
        Some(replay) => format!("{name}={},{replay}", p.endpoint()),
        None => format!("{name}={}", p.endpoint()),
    }
}

/// A new publisher process on an earlier one's addresses: seq from 0, nothing cached.
fn restart_publisher(ctx: &zmq::Context, events: &str, replay: &str) -> EventPublisher {
    EventPublisher::start(
        ctx,
        PublisherConfig {
            endpoint: events.to_owned(),
            replay_endpoint: Some(replay.to_owned()),
            ..PublisherConfig::default()
        },
    )
    .unwrap()
}

fn own(d: &Digest) -> u64 {
    d.block_key().0
}

#[test]
fn replays_events_published_before_it_started_and_follows_live_ones() {
    let ctx = zmq::Context::new();
    let (pa, pb) = (publisher(&ctx), publisher(&ctx));
    let first = prompt(1, 4);
    pa.publish(&batch(vec![stored(&first, 0, own)])).unwrap();
    let daemon = DaemonProcess::start(&[
        "--endpoint",
        &endpoint_flag(A, &pa),
        "--endpoint",
        &endpoint_flag(B, &pb),
    ]);
    daemon.wait_ready();
    assert_eq!(daemon.matched(&keys(&first), A), 4);
    assert_eq!(daemon.matched(&keys(&first), B), 0);
    let answer = daemon.lookup(&keys(&first));
    assert_eq!(answer["index"], "complete");
    assert_eq!(answer["ranked"][0], A);

    // A continuation stored on B, chained from a prefix B computed itself.
    let mut longer = first.clone();
    longer.extend(prompt(2, 2));
    pb.publish(&batch(vec![stored(&longer, 0, own)])).unwrap();
    wait_for("B's blocks", || daemon.matched(&keys(&longer), B) == 6);
    assert_eq!(daemon.matched(&keys(&longer), A), 4);
    assert_eq!(daemon.lookup(&keys(&longer))["ranked"][0], B);
    assert_eq!(daemon.endpoint_status(A)["alignment"], "aligned");
}

#[test]
fn a_live_gap_is_filled_by_replay() {
    let ctx = zmq::Context::new();
    let p = publisher(&ctx);
    let daemon = DaemonProcess::start(&["--endpoint", &endpoint_flag(A, &p)]);
    daemon.wait_ready();
    let (lost, after) = (prompt(10, 3), prompt(11, 2));
    p.publish_lost(&batch(vec![stored(&lost, 0, own)])).unwrap();
    let published = std::time::Instant::now();
    p.publish(&batch(vec![stored(&after, 0, own)])).unwrap();
    wait_for("the lost batch, replayed", || {
        daemon.matched(&keys(&lost), A) == 3
    });
    println!(
        "event gap: the lost batch was replayed and indexed {:?} after the next one was published",
        published.elapsed()
    );
    assert_eq!(daemon.matched(&keys(&after), A), 2);
    assert!(daemon.metric("kvaffined_replays_total{endpoint=\"127.0.0.1:1\"}") >= 2.0);
    assert_eq!(daemon.endpoint_status(A)["incomplete"], json!(null));
}

#[test]
fn without_a_replay_socket_a_gap_flags_the_endpoint_incomplete_but_keeps_it() {
    let ctx = zmq::Context::new();
    let config = PublisherConfig {
        replay_endpoint: None,
        ..PublisherConfig::default()
    };
    let p = EventPublisher::start(&ctx, config).unwrap();
    let daemon = DaemonProcess::start(&["--endpoint", &endpoint_flag(A, &p)]);
    daemon.wait_ready();
    let answer = daemon.lookup(&[1]);
    assert_eq!(answer["index"], "incomplete");
    let live = prompt(20, 2);
    // The SUB may join after the first messages: publish until one is seen.
    wait_for("a live batch", || {
        p.publish(&batch(vec![stored(&live, 0, own)])).unwrap();
        daemon.matched(&keys(&live), A) == 2
    });
    assert_eq!(daemon.lookup(&keys(&live))["ranked"][0], A);
}

/// A replica whose event stream goes away (its process stopped, crashed or is restarting)
/// stops being pinned at once, even while it holds the longest prefix, and is ranked again
/// when its stream is back.
#[test]
fn a_replica_whose_event_stream_is_gone_is_ranked_last_until_it_is_back() {
    let first_process = zmq::Context::new();
    let gone = publisher(&first_process);
    let (pub_url, replay_url) = (
        gone.endpoint().to_owned(),
        gone.replay_endpoint().unwrap().to_owned(),
    );
    let ctx = zmq::Context::new();
    let other = publisher(&ctx);
    let held = prompt(40, 3);
    gone.publish(&batch(vec![stored(&held, 0, own)])).unwrap();
    let daemon = DaemonProcess::start(&[
        "--endpoint",
        &format!("{A}={pub_url},{replay_url}"),
        "--endpoint",
        &endpoint_flag(B, &other),
    ]);
    daemon.wait_ready();
    let k = keys(&held);
    assert_eq!(daemon.lookup(&k)["ranked"][0], A, "it holds the prefix");
    drop(gone);
    drop(first_process);
    wait_for("the lost stream seen", || {
        daemon.endpoint_status(A)["events_disconnected"] == true
    });
    let answer = daemon.lookup(&k);
    assert_eq!(answer["ranked"][0], B, "{answer}");
    let record = |answer: &serde_json::Value| {
        answer["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == A)
            .unwrap()
            .clone()
    };
    assert_eq!(record(&answer)["connected"], false);
    let restarted = restart_publisher(&ctx, &pub_url, &replay_url);
    wait_for("the stream back", || {
        daemon.endpoint_status(A)["events_disconnected"] == false
    });
    let fresh = prompt(41, 2);
    wait_for("ranked first again for what it holds now", || {
        restarted
            .publish(&batch(vec![stored(&fresh, 0, own)]))
            .unwrap();
        daemon.lookup(&keys(&fresh))["ranked"][0] == A
    });
}

/// A restarted replica is purged and followed from seq 0. Its first process's replay kept
/// two batches of three, so the index was incomplete (it may hold anything, every salt
/// included); rebuilt from the new process's first batch, it is whole again.
#[test]
fn a_restarted_replica_is_purged_and_resynced() {
    // The first "process" has its own context: terminating it releases the ports, as a
    // process exit does.
    let first_process = zmq::Context::new();
    let p = EventPublisher::start(
        &first_process,
        PublisherConfig {
            buffer_steps: 2,
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    let (pub_url, replay_url) = (
        p.endpoint().to_owned(),
        p.replay_endpoint().unwrap().to_owned(),
    );
    let old = prompt(30, 3);
    for _ in 0..3 {
        p.publish(&batch(vec![stored(&old, 0, own)])).unwrap();
    }
    let daemon = DaemonProcess::start(&["--endpoint", &format!("{A}={pub_url},{replay_url}")]);
    daemon.wait_ready();
    wait_for("old blocks", || daemon.matched(&keys(&old), A) == 3);
    assert_ne!(daemon.endpoint_status(A)["incomplete"], json!(null));
    assert_eq!(daemon.lookup(&keys(&old))["index"], "incomplete");
    drop(p);
    drop(first_process);
    let ctx = zmq::Context::new();
    // The same addresses, a new process: seq starts at 0 again, the cache is empty.
    let restarted = restart_publisher(&ctx, &pub_url, &replay_url);
    let fresh = prompt(31, 2);
    wait_for("the restart to be seen", || {
        restarted
            .publish(&batch(vec![stored(&fresh, 0, own)]))
            .unwrap();
        daemon.matched(&keys(&fresh), A) == 2
    });
    assert_eq!(
        daemon.matched(&keys(&old), A),
        0,
        "blocks of the old process purged"
    );
    assert!(daemon.metric("kvaffined_replica_restarts_total{endpoint=\"127.0.0.1:1\"}") >= 1.0);
    wait_for("the rebuilt index whole", || {
        daemon.endpoint_status(A)["incomplete"].is_null()
    });
    assert_eq!(daemon.lookup(&keys(&fresh))["index"], "complete");
    assert_eq!(
        daemon.metric("kvaffined_endpoint_incomplete{endpoint=\"127.0.0.1:1\"}"),
        0.0
    );
}

#[test]
fn an_endpoint_publishing_foreign_hashes_is_rekeyed_from_tokens() {
    let ctx = zmq::Context::new();
    let p = publisher(&ctx);
    let tokens = prompt(40, 5);
    // Blocks 0-2 first, then 3-4 chained from block 2, as vLLM reports a continuation.
    p.publish(&batch(vec![stored(&tokens[..3 * BLOCK_SIZE], 0, opaque)]))
        .unwrap();
    p.publish(&batch(vec![stored(&tokens, 3, opaque)])).unwrap();
    let daemon = DaemonProcess::start(&["--endpoint", &endpoint_flag(A, &p)]);
    daemon.wait_ready();
    wait_for("re-keyed blocks", || daemon.matched(&keys(&tokens), A) == 5);
    let status = daemon.endpoint_status(A);
    assert_eq!(status["alignment"], "rekeyed");
    assert_eq!(status["rekey_entries"], 5);
    // Evicting block 3 (by its engine hash) cuts the match there.
    let engine: Vec<u64> = digests(&tokens).iter().map(opaque).collect();
    p.publish(&batch(vec![removed(&engine[3..4])])).unwrap();
    wait_for("translated removal", || {
        daemon.matched(&keys(&tokens), A) == 3
    });
    assert_eq!(
        daemon.metric("kvaffined_endpoint_alignment{endpoint=\"127.0.0.1:1\",mode=\"rekeyed\"}"),
        1.0
    );
}

/// One batch whose block says 32 tokens, against the daemons' 16.
fn publish_block_size_32(p: &EventPublisher) {
    let mut event = stored(&prompt(50, 2), 0, own);
    if let kvaffine_core::events::KvEvent::BlockStored(s) = &mut event {
        s.block_size = 32;
    }
    p.publish(&batch(vec![event])).unwrap();
}

/// Whether the daemon reports `endpoint` misconfigured for the 32-token blocks.
fn flagged_block_size_32(daemon: &DaemonProcess, endpoint: &str) -> bool {
    daemon.endpoint_status(endpoint)["misconfigured"]
        .as_str()
        .is_some_and(|s| s.contains("block size 32"))
}

#[test]
fn a_foreign_block_size_marks_the_endpoint_misconfigured() {
    let ctx = zmq::Context::new();
    let p = publisher(&ctx);
    publish_block_size_32(&p);
    let daemon = DaemonProcess::start(&["--endpoint", &endpoint_flag(A, &p)]);
    daemon.wait_ready();
    wait_for("misconfiguration", || flagged_block_size_32(&daemon, A));
    assert_eq!(
        daemon.metric("kvaffined_endpoint_misconfigured{endpoint=\"127.0.0.1:1\"}"),
        1.0
    );
}

#[test]
fn a_block_size_only_the_events_show_stays_flagged_through_scrapes() {
    // The replica's /metrics agrees with the daemon (16); its events say 32.
    let replica = EmuProcess::start(&["--block-size", "16"]);
    let ctx = zmq::Context::new();
    let p = publisher(&ctx);
    publish_block_size_32(&p);
    let daemon = DaemonProcess::start(&[
        "--endpoint",
        &endpoint_flag(&replica.http, &p),
        "--scrape-interval-ms",
        "20",
    ]);
    daemon.wait_ready();
    wait_for("misconfiguration", || {
        flagged_block_size_32(&daemon, &replica.http)
    });
    // Twenty-odd scrapes of an agreeing /metrics: the flag holds on every look (before the
    // fix, the first of them cleared it for good, no later batch setting it again).
    let window = std::time::Instant::now();
    while window.elapsed() < std::time::Duration::from_millis(500) {
        assert!(
            flagged_block_size_32(&daemon, &replica.http),
            "cleared by a scrape"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(
        daemon.metric(&format!(
            "kvaffined_endpoint_misconfigured{{endpoint=\"{}\"}}",
            replica.http
        )),
        1.0
    );
}

#[test]
fn removals_cache_resets_and_config_changes_are_applied() {
    let ctx = zmq::Context::new();
    let (pa, pb) = (publisher(&ctx), publisher(&ctx));
    let dir = std::env::temp_dir().join(format!("kvaffined-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("endpoints.json");
    let entry = |name: &str, p: &EventPublisher| json!({"endpoint": name, "events": p.endpoint(), "replay": p.replay_endpoint()});
    std::fs::write(&config, json!({"endpoints": [entry(A, &pa)]}).to_string()).unwrap();
    let daemon = DaemonProcess::start(&["--config", config.to_str().unwrap()]);
    daemon.wait_ready();
    let tokens = prompt(60, 4);
    let k = keys(&tokens);
    pa.publish(&batch(vec![stored(&tokens, 0, own)])).unwrap();
    wait_for("stored", || daemon.matched(&k, A) == 4);
    pa.publish(&batch(vec![removed(&k[2..3])])).unwrap();
    wait_for("removed", || daemon.matched(&k, A) == 2);
    pa.publish(&batch(vec![
        kvaffine_core::events::KvEvent::AllBlocksCleared,
    ]))
    .unwrap();
    wait_for("cleared", || daemon.matched(&k, A) == 0);

    pa.publish(&batch(vec![stored(&tokens, 0, own)])).unwrap();
    wait_for("stored again", || daemon.matched(&k, A) == 4);
    let replacement = dir.join("next.json");
    std::fs::write(
        &replacement,
        json!({"endpoints": [entry(B, &pb)]}).to_string(),
    )
    .unwrap();
    std::fs::rename(&replacement, &config).unwrap();
    wait_for("A removed, B added", || {
        let answer = daemon.lookup(&k);
        answer["endpoints"].as_array().unwrap().len() == 1
            && answer["endpoints"][0]["endpoint"] == B
    });
    assert_eq!(daemon.matched(&k, B), 0, "A's blocks never count for B");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_endpoint_removed_under_event_traffic_leaves_nothing_for_the_next_in_its_slot() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let ctx = zmq::Context::new();
    let (pa, pb) = (publisher(&ctx), publisher(&ctx));
    let dir = std::env::temp_dir().join(format!("kvaffined-slots-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("endpoints.json");
    // B's own blocks, published before anyone follows it: each time B is added it
    // replays them, and they are all the index may hold while B is alone.
    let own_blocks = prompt(77, 3);
    pb.publish(&batch(vec![stored(&own_blocks, 0, own)]))
        .unwrap();
    let (a, b) = (
        json!({"endpoint": A, "events": pa.endpoint()}),
        json!({"endpoint": B, "events": pb.endpoint(), "replay": pb.replay_endpoint()}),
    );
    let follow = |entries: serde_json::Value| {
        let next = dir.join("next.json");
        std::fs::write(&next, json!({ "endpoints": entries }).to_string()).unwrap();
        std::fs::rename(&next, &config).unwrap();
    };
    follow(json!([a]));
    let daemon = DaemonProcess::start(&["--config", config.to_str().unwrap()]);
    daemon.wait_ready();
    // A publishes fresh blocks without pause, followed or not.
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut seed = 1_000;
            while !stop.load(Ordering::Relaxed) {
                pa.publish(&batch(vec![stored(&prompt(seed, 4), 0, own)]))
                    .unwrap();
                seed += 1;
                std::thread::sleep(std::time::Duration::from_micros(500));
            }
        })
    };
    let alone = |name: &str| {
        let (_, value) = daemon.json("GET", "/v1/endpoints", "");
        let endpoints = value["endpoints"].as_array().unwrap().clone();
        endpoints.len() == 1 && endpoints[0]["endpoint"] == name
    };
    let replayed_alone = |name: &str| alone(name) && daemon.endpoint_status(name)["synced"] == true;
    for round in 0..6 {
        follow(json!([a]));
        wait_for(&format!("A followed, round {round}"), || {
            alone(A) && daemon.metric("kvaffined_index_entries") > 0.0
        });
        // B takes A's slot the moment A is gone.
        follow(json!([b]));
        wait_for("B alone, replayed", || replayed_alone(B));
        assert_eq!(
            daemon.metric("kvaffined_index_entries"),
            3.0,
            "round {round}: blocks A's ingest applied after its removal count for B"
        );
        assert_eq!(daemon.matched(&keys(&own_blocks), B), 3);
    }
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    let own_blocks = prompt(77, 3);
    pb.publish(&batch(vec![stored(&own_blocks, 0, own)]))
        .unwrap();
    wait_for("B's own blocks", || {
        daemon.matched(&keys(&own_blocks), B) == 3
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_booking_holds_a_fresh_prefix_for_its_siblings_until_it_expires() {
    let ctx = zmq::Context::new();
    let (pa, pb) = (publisher(&ctx), publisher(&ctx));
    let daemon = DaemonProcess::start(&[
        "--endpoint",
        &endpoint_flag(A, &pa),
        "--endpoint",
        &endpoint_flag(B, &pb),
        // The booked prefill is estimated done within about 3 ms.
        "--prefill-tokens-per-second",
        "100000",
    ]);
    daemon.wait_ready();
    let k = keys(&prompt(70, 6));
    let book = |ttl: u64| {
        let body = json!({"keys": k, "book": {"ttl_ms": ttl}}).to_string();
        daemon.json("POST", "/v1/lookup", &body).1
    };
    let first = book(60_000);
    let booked = first["booked"].as_str().unwrap().to_owned();
    assert_eq!(first["reason"], "load");
    // A sibling with the same prefix after the first one's prefill, before any event: it
    // follows the booking. (One arriving during that prefill would recompute wherever it
    // went, so it is sent wherever that is cheapest.)
    let mut sibling = daemon.lookup(&k);
    wait_for("the booked prefill to be done", || {
        sibling = daemon.lookup(&k);
        sibling["ranked"][0] == booked.as_str()
    });
    assert_eq!(sibling["reason"], "prefix");
    let entry = DaemonProcess::record(&sibling, &booked);
    assert_eq!(
        (
            entry["matched_blocks"].as_u64(),
            entry["indexed_blocks"].as_u64()
        ),
        (Some(6), Some(0))
    );
    // At most six uncached blocks plus the request's fixed cost (200), draining.
    let pending = entry["pending_prefill_tokens"].as_u64().unwrap();
    assert!(pending <= 6 * BLOCK_SIZE as u64 + 200, "{pending}");
    // A booking that expires stops counting.
    let other = keys(&prompt(71, 2));
    let body = json!({"keys": other, "book": {"ttl_ms": 1}}).to_string();
    daemon.json("POST", "/v1/lookup", &body);
    wait_for("expiry", || {
        daemon.lookup(&other)["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["matched_blocks"] == 0)
    });
}

#[test]
fn malformed_frames_are_counted_and_never_fatal() {
    let ctx = zmq::Context::new();
    let p = publisher(&ctx);
    let daemon = DaemonProcess::start(&["--endpoint", &endpoint_flag(A, &p)]);
    daemon.wait_ready();
    let good = prompt(80, 2);
    wait_for("garbage counted and a good batch applied", || {
        p.publish_raw(&[b"", b"short"]).unwrap();
        p.publish_raw(&[b"", &7u64.to_be_bytes(), b"\xc1not msgpack"])
            .unwrap();
        p.publish(&batch(vec![stored(&good, 0, own)])).unwrap();
        daemon.metric("kvaffined_decode_errors_total{endpoint=\"127.0.0.1:1\"}") >= 2.0
            && daemon.matched(&keys(&good), A) == 2
    });
}

/// One replica's socket turns hostile (garbage frames, a payload claiming four billion
/// events, a batch whose event claims four billion block hashes): that endpoint is
/// flagged in `/v1/endpoints` and counted, and the other endpoint's routing is untouched.
#[test]
fn a_hostile_publisher_is_flagged_and_the_others_route_on() {
    let ctx = zmq::Context::new();
    let (hostile, healthy) = (publisher(&ctx), publisher(&ctx));
    let daemon = DaemonProcess::start(&[
        "--endpoint",
        &endpoint_flag(A, &hostile),
        "--endpoint",
        &endpoint_flag(B, &healthy),
    ]);
    daemon.wait_ready();
    let good = prompt(81, 3);
    let seq = 7u64.to_be_bytes();
    wait_for(
        "the hostile endpoint flagged and the healthy one followed",
        || {
            hostile.publish_raw(&[b"", b"short"]).unwrap();
            // [ts, events: array of 2^32 - 1, ...]
            hostile
                .publish_raw(&[
                    b"",
                    &seq,
                    b"\x93\xcb\x41\xd0\x00\x00\x00\x00\x00\x00\xdd\xff\xff\xff\xff",
                ])
                .unwrap();
            // One BlockStored map whose block_hashes claims 2^32 - 1 entries.
            hostile
            .publish_raw(&[b"", &seq, b"\x93\xcb\x41\xd0\x00\x00\x00\x00\x00\x00\x91\x82\xa4type\xabBlockStored\xacblock_hashes\xdd\xff\xff\xff\xff"])
            .unwrap();
            healthy
                .publish(&batch(vec![stored(&good, 0, own)]))
                .unwrap();
            let flagged = daemon.endpoint_status(A);
            flagged["decode_errors"].as_u64().unwrap_or(0) >= 3
                && flagged["last_decode_error"].is_string()
                && daemon.matched(&keys(&good), B) == 3
        },
    );
    assert_eq!(daemon.endpoint_status(B)["decode_errors"], 0);
    assert!(daemon.metric("kvaffined_decode_errors_total{endpoint=\"127.0.0.1:1\"}") >= 3.0);
    let answer = daemon.lookup(&keys(&good));
    assert_eq!(answer["ranked"][0], B);
    assert_eq!(answer["reason"], "prefix");
    assert_eq!(daemon.request("GET", "/healthz", "").0, 200);
}

/// A message past `--max-event-message-bytes` is never read: libzmq drops the connection
/// instead of buffering it, so its blocks, valid as they are, are not indexed; the
/// publisher's next small batch is, once it has reconnected, and the other replica's
/// routing is untouched.
#[test]
fn an_event_message_past_the_byte_bound_is_refused_and_the_stream_goes_on() {
    let ctx = zmq::Context::new();
    let no_replay = || PublisherConfig {
        replay_endpoint: None,
        ..PublisherConfig::default()
    };
    let (big, healthy) = (
        EventPublisher::start(&ctx, no_replay()).unwrap(),
        EventPublisher::start(&ctx, no_replay()).unwrap(),
    );
    let daemon = DaemonProcess::start(&[
        "--max-event-message-bytes",
        "65536",
        "--endpoint",
        &endpoint_flag(A, &big),
        "--endpoint",
        &endpoint_flag(B, &healthy),
    ]);
    daemon.wait_ready();
    let small = prompt(90, 2);
    wait_for("the stream followed", || {
        big.publish(&batch(vec![stored(&small, 0, own)])).unwrap();
        daemon.matched(&keys(&small), A) == 2
    });
    let long = prompt(91, 32_768 / BLOCK_SIZE);
    let long_batch = batch(vec![stored(&long, 0, own)]);
    let bytes = kvaffine_core::events::encode_batch(&long_batch, EventFormat::Map).len();
    assert!(bytes > 65_536, "{bytes} bytes");
    big.publish(&long_batch).unwrap();
    let after = prompt(92, 3);
    let good = prompt(93, 2);
    wait_for("the next small batch indexed after a reconnect", || {
        big.publish(&batch(vec![stored(&after, 0, own)])).unwrap();
        healthy
            .publish(&batch(vec![stored(&good, 0, own)]))
            .unwrap();
        daemon.matched(&keys(&after), A) == 3 && daemon.matched(&keys(&good), B) == 2
    });
    assert_eq!(daemon.matched(&keys(&long), A), 0);
    assert_eq!(daemon.lookup(&keys(&good))["ranked"][0], B);
}

/// One replica's socket publishes about 50,000 fresh blocks a second. With `--max-entries`
/// 20,000 over two streams it fills its share (10,000) and no more; it is flagged
/// (`dropped_entries` in `/v1/endpoints`, the metric), and the other replica's blocks,
/// published during the flood, are indexed and ranked first.
#[test]
fn a_publisher_flooding_blocks_keeps_to_its_share_of_the_index() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    let ctx = zmq::Context::new();
    let (flooder, healthy) = (publisher(&ctx), publisher(&ctx));
    let daemon = DaemonProcess::start(&[
        "--max-entries",
        "20000",
        "--endpoint",
        &endpoint_flag(A, &flooder),
        "--endpoint",
        &endpoint_flag(B, &healthy),
    ]);
    daemon.wait_ready();
    let rss_before = daemon.rss_kib();
    let flood_started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (started, mut published, mut seed) = (Instant::now(), 0usize, 10_000u32);
            while !stop.load(Ordering::Relaxed) {
                let events: Vec<_> = (0..500)
                    .map(|_| {
                        seed += 1;
                        stored(&prompt(seed, 1), 0, own)
                    })
                    .collect();
                flooder.publish(&batch(events)).unwrap();
                published += 500;
                // About 50,000 a second: 500 every 10 ms, as far as this machine keeps up.
                let due = started + Duration::from_millis(published as u64 / 50);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
            }
            published as f64 / started.elapsed().as_secs_f64()
        })
    };
    wait_for("the flooder past its share", || {
        daemon.endpoint_status(A)["dropped_entries"].as_u64() > Some(0)
    });
    let tokens = prompt(5, 4);
    let k = keys(&tokens);
    wait_for(
        "the healthy replica's blocks indexed during the flood",
        || {
            healthy
                .publish(&batch(vec![stored(&tokens, 0, own)]))
                .unwrap();
            daemon.matched(&k, B) == 4
        },
    );
    assert_eq!(daemon.lookup(&k)["ranked"][0], B);
    // Sustained, the flood adds nothing: three seconds of it, then the same share.
    std::thread::sleep(Duration::from_secs(3).saturating_sub(flood_started.elapsed()));
    stop.store(true, Ordering::Relaxed);
    let rate = flood.join().unwrap();
    let grown_mib = daemon.rss_kib().saturating_sub(rss_before) / 1024;
    assert!(grown_mib < 64, "RSS grew {grown_mib} MiB under the flood");
    let (_, endpoints) = daemon.json("GET", "/v1/endpoints", "");
    let held = |name: &str| {
        endpoints["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == name)
            .unwrap()["index_entries"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(
        held(A),
        10_000,
        "the flooder holds its share, at {rate:.0} blocks/s"
    );
    assert_eq!(held(B), 4);
    assert!(daemon.metric("kvaffined_index_dropped_entries_total{endpoint=\"127.0.0.1:1\"}") > 0.0);
    assert!(daemon.metric("kvaffined_index_entries") <= 20_000.0);
}

#[test]
fn the_api_answers_bad_requests_with_json_errors() {
    let daemon = DaemonProcess::start(&["--max-keys", "4"]);
    let (status, body) = daemon.json("POST", "/v1/lookup", "{not json");
    assert_eq!(status, 400);
    assert!(body["error"].as_str().unwrap().contains("invalid request"));
    let (status, _) = daemon.json("POST", "/v1/lookup", r#"{"keys":[-1]}"#);
    assert_eq!(status, 400);
    let (status, body) = daemon.json("POST", "/v1/lookup", r#"{"keys":[1,2,3,4,5]}"#);
    assert_eq!(status, 413);
    assert!(body["error"].as_str().unwrap().contains("--max-keys 4"));
    let huge = format!(r#"{{"keys":[{}]}}"#, vec!["1"; 100_000].join(","));
    assert_eq!(daemon.json("POST", "/v1/lookup", &huge).0, 413);
    // Salt probes too: 413 for a body or text over the limit, never the 400 a filter
    // reads as a daemon that does not know the probe's fields.
    let (status, body) = daemon.json("POST", "/v2/salt", r#"{"salt":1,"text":[1,2,3,4,5]}"#);
    assert_eq!(status, 413);
    assert!(body["error"].as_str().unwrap().contains("--max-keys 4"));
    let huge = format!(r#"{{"salt":1,"text":[{}]}}"#, vec!["1"; 100_000].join(","));
    assert_eq!(daemon.json("POST", "/v2/salt", &huge).0, 413);
    let answer = daemon.lookup(&[1, 2]);
    assert_eq!(
        answer,
        json!({"endpoints": [], "ranked": [], "index": "complete", "reason": "no-candidates"})
    );
    assert_eq!(daemon.request("GET", "/healthz", "").0, 200);
    assert_eq!(daemon.request("GET", "/readyz", "").0, 200);
}

#[test]
fn it_binds_loopback_unless_told_otherwise() {
    let daemon = DaemonProcess::start(&[]);
    assert!(daemon.addr.starts_with("127.0.0.1:"));
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_kvaffined"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("[default: 127.0.0.1:9100]"));
}

#[test]
fn follows_emulated_replicas_found_through_kv_event_sources() {
    let (a, b) = (
        EmuProcess::start(&["--block-size", "16"]),
        EmuProcess::start(&["--block-size", "16"]),
    );
    let daemon = DaemonProcess::start(&["--discover", &a.http, "--discover", &b.http]);
    daemon.wait_ready();
    let messages = json!([{"role": "user", "content": "route me ".repeat(80)}]);
    let (_, tokenized) = a.post("/tokenize", &json!({"messages": messages}));
    let tokens: Vec<u32> = serde_json::from_value(tokenized["tokens"].clone()).unwrap();
    let k = keys(&tokens);
    assert!(k.len() >= 8);
    let (status, _) = a.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    wait_for("the replica's blocks", || {
        daemon.matched(&k, &a.http) == k.len() as u64
    });
    assert_eq!(daemon.matched(&k, &b.http), 0);
    wait_for("a scrape", || {
        daemon.endpoint_status(&a.http)["load"].is_object()
    });
    let answer = daemon.lookup(&k);
    assert_eq!(answer["ranked"][0], a.http.as_str());
    assert_eq!(answer["reason"], "prefix");
}

#[test]
fn follows_replicas_behind_a_dns_name_by_their_addresses() {
    let replica = EmuProcess::start(&["--block-size", "16"]);
    let port = replica.http.rsplit_once(':').unwrap().1;
    // `localhost` may also resolve to ::1, where nothing listens: that address is skipped
    // until it answers, and the IPv4 one is followed under its address.
    let daemon = DaemonProcess::start(&["--discover-dns", &format!("localhost:{port}")]);
    daemon.wait_ready();
    let messages = json!([{"role": "user", "content": "resolve me ".repeat(80)}]);
    let (_, tokenized) = replica.post("/tokenize", &json!({"messages": messages}));
    let tokens: Vec<u32> = serde_json::from_value(tokenized["tokens"].clone()).unwrap();
    let k = keys(&tokens);
    let (status, _) = replica.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    wait_for("the replica's blocks under its address", || {
        daemon.matched(&k, &replica.http) == k.len() as u64
    });
    assert_eq!(daemon.lookup(&k)["ranked"][0], replica.http.as_str());
}

#[test]
fn a_replica_with_another_block_size_or_hash_algo_is_flagged_from_its_metrics() {
    let wrong_size = EmuProcess::start(&["--block-size", "32"]);
    let opaque = EmuProcess::start(&["--block-size", "16", "--engine-hash", "opaque"]);
    let daemon = DaemonProcess::start(&[
        "--endpoint",
        &wrong_size.endpoint_flag(),
        "--endpoint",
        &opaque.endpoint_flag(),
    ]);
    daemon.wait_ready();
    wait_for("block size flagged", || {
        daemon.endpoint_status(&wrong_size.http)["misconfigured"]
            .as_str()
            .is_some_and(|m| m.contains("block_size 32"))
    });
    wait_for("hash algorithm flagged", || {
        daemon.endpoint_status(&opaque.http)["misconfigured"]
            .as_str()
            .is_some_and(|m| m.contains("prefix_caching_hash_algo sha256"))
    });
    // The opaque replica still routes: its events are re-keyed.
    let messages = json!([{"role": "user", "content": "opaque ".repeat(100)}]);
    let (_, tokenized) = opaque.post("/tokenize", &json!({"messages": messages}));
    let tokens: Vec<u32> = serde_json::from_value(tokenized["tokens"].clone()).unwrap();
    opaque.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2}),
    );
    wait_for("re-keyed blocks", || {
        daemon.matched(&keys(&tokens), &opaque.http) == keys(&tokens).len() as u64
    });
    assert_eq!(daemon.endpoint_status(&opaque.http)["alignment"], "rekeyed");
}

#[test]
fn a_killed_and_restarted_emulated_replica_is_purged() {
    let mut emu = EmuProcess::start(&["--block-size", "16"]);
    let daemon = DaemonProcess::start(&["--endpoint", &emu.endpoint_flag()]);
    daemon.wait_ready();
    let old = json!([{"role": "user", "content": "before the crash ".repeat(40)}]);
    let (_, tokenized) = emu.post("/tokenize", &json!({"messages": old}));
    let old_keys = keys(&serde_json::from_value::<Vec<u32>>(tokenized["tokens"].clone()).unwrap());
    for _ in 0..3 {
        emu.post(
            "/v1/chat/completions",
            &json!({"messages": old, "max_tokens": 2}),
        );
    }
    wait_for("old blocks", || daemon.matched(&old_keys, &emu.http) > 0);
    emu.restart();
    let fresh = json!([{"role": "user", "content": "after the restart ".repeat(40)}]);
    let (_, tokenized) = emu.post("/tokenize", &json!({"messages": fresh}));
    let fresh_keys =
        keys(&serde_json::from_value::<Vec<u32>>(tokenized["tokens"].clone()).unwrap());
    wait_for("the restarted replica's blocks", || {
        emu.post(
            "/v1/chat/completions",
            &json!({"messages": fresh, "max_tokens": 2}),
        );
        daemon.matched(&fresh_keys, &emu.http) > 0
    });
    assert_eq!(
        daemon.matched(&old_keys, &emu.http),
        0,
        "the crashed process's blocks are gone"
    );
}

#[test]
fn random_lookup_bodies_get_answers_or_json_errors_never_a_crash() {
    let daemon = DaemonProcess::start(&["--max-keys", "64"]);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let valid = json!({"keys": [1, 2, 3], "model": "m", "book": {"ttl_ms": 5}}).to_string();
    let mut statuses = std::collections::BTreeMap::new();
    for round in 0..1500 {
        let body: Vec<u8> = match round % 3 {
            // Random bytes.
            0 => (0..(next() % 200)).map(|_| next() as u8).collect(),
            // A valid body with bytes flipped.
            1 => {
                let mut b = valid.clone().into_bytes();
                for _ in 0..1 + next() % 4 {
                    let at = (next() as usize) % b.len();
                    b[at] = next() as u8;
                }
                b
            }
            // Valid JSON of the wrong shapes.
            _ => {
                let shapes = [
                    json!({"keys": "x"}),
                    json!({"keys": [-1]}),
                    json!({"keys": [1.5]}),
                    json!({"keys": [1], "book": 3}),
                    json!({"keys": (0..65).collect::<Vec<u64>>()}),
                    json!({"keys": [], "approximate": true, "book": {}}),
                    json!([1, 2]),
                    json!({"keys": [u64::MAX], "model": null}),
                ];
                shapes[(next() as usize) % shapes.len()]
                    .to_string()
                    .into_bytes()
            }
        };
        let (status, _) = http(
            &daemon.addr,
            "POST",
            "/v1/lookup",
            &String::from_utf8_lossy(&body),
        );
        *statuses.entry(status).or_insert(0) += 1;
    }
    assert!(
        statuses.keys().all(|s| [200, 400, 413].contains(s)),
        "{statuses:?}"
    );
    assert_eq!(
        daemon.lookup(&[1, 2, 3])["index"],
        "complete",
        "still serving"
    );
}

/// A salt probe answers from the replicas' events: "tokenize" while a replica holds a
/// first block of the salt (sent to it straight, around any gateway), else routed by load
/// (`new-salt`) and booked, the salt's next probes following that booking (`salt-booked`:
/// the salt's own queued picks do not count against it); once the replica evicts the
/// salt's blocks (a cleared cache) it is new again.
#[test]
fn salt_probes_answer_from_first_blocks_and_bookings() {
    let (a, b) = (
        EmuProcess::start(&["--block-size", "16"]),
        EmuProcess::start(&["--block-size", "16"]),
    );
    let daemon = DaemonProcess::start(&["--discover", &a.http, "--discover", &b.http]);
    daemon.wait_ready();
    wait_for("both scraped", || {
        [&a.http, &b.http]
            .iter()
            .all(|e| daemon.endpoint_status(e)["load"].is_object())
    });
    let probe = |salt: &str, book: bool| {
        let mut body =
            json!({"salt": kvaffine_core::salt_tag(salt), "candidates": 2, "tokens": 2_000});
        if book {
            body["book"] = json!({"ttl_ms": 60_000});
        }
        let (status, answer) = daemon.json("POST", "/v2/salt", &body.to_string());
        assert_eq!(status, 200, "{answer}");
        answer
    };
    let messages = json!([{"role": "user", "content": "salted ".repeat(80)}]);
    let (status, _) = a.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2, "cache_salt": "held"}),
    );
    assert_eq!(status, 200);
    wait_for("the salt in A's events", || {
        probe("held", false).get("route").is_none()
    });
    let held = probe("held", true);
    assert!(held["tokenize_at"].is_string(), "{held}");
    assert!(daemon.metric("kvaffined_salt_probes_held_total") >= 2.0);

    let first = probe("new", true);
    let route = &first["route"];
    assert_eq!(route["reason"], "new-salt", "{first}");
    assert_eq!(route["candidates"][0]["matched_blocks"], 0);
    assert_eq!(route["candidates"].as_array().map(Vec::len), Some(2));
    let booked = route["booked"].as_str().unwrap().to_owned();
    assert_eq!(route["candidates"][0]["endpoint"], booked.as_str());
    for _ in 0..3 {
        let next = probe("new", true);
        assert_eq!(next["route"]["reason"], "salt-booked", "{next}");
        assert_eq!(next["route"]["candidates"][0]["endpoint"], booked.as_str());
    }
    // Unbooked probes of a salt nobody holds or booked are routed, not booked.
    let unbooked = probe("never", false);
    assert_eq!(unbooked["route"]["reason"], "new-salt");
    assert!(unbooked["route"]["booked"].is_null(), "{unbooked}");
    assert_eq!(probe("never", false)["route"]["reason"], "new-salt");

    // A's cache cleared (published with A's next step, as vLLM does): its salt is new again.
    let (status, _) = a.post("/reset_prefix_cache", &json!({}));
    assert_eq!(status, 200);
    let (status, _) = a.post("/v1/completions", &json!({"prompt": "a", "max_tokens": 1}));
    assert_eq!(status, 200);
    wait_for("the salt gone with A's blocks", || {
        probe("held", false)["route"]["reason"] == "new-salt"
    });
}

/// With text keys (what filters send since they have them), a salt's next probe follows
/// its booked first request only as far as their texts and templates agree: a sibling
/// sharing the first's document goes where it went (`salt-booked`) once the first's
/// prefill there has drained, while one whose keys differ from the first chunk on (another
/// template renders it) is ranked by load like any new prompt (`new-salt`), away from the
/// prefill queued there. No answer claims a matched block: no replica's events show the
/// salt. Once the salt's booking expires, where it went counts no more.
#[test]
fn salt_probes_with_text_follow_the_first_request_as_far_as_they_agree() {
    let (a, b) = (
        EmuProcess::start(&["--block-size", "16"]),
        EmuProcess::start(&["--block-size", "16"]),
    );
    let daemon = DaemonProcess::start(&[
        "--discover",
        &a.http,
        "--discover",
        &b.http,
        "--prefill-tokens-per-second",
        "10000",
    ]);
    daemon.wait_ready();
    wait_for("both scraped", || {
        [&a.http, &b.http]
            .iter()
            .all(|e| daemon.endpoint_status(e)["load"].is_object())
    });
    let salt = kvaffine_core::salt_tag("team");
    // 20,000 tokens: two seconds of booked prefill at 10,000 tokens/s.
    let probe = |text: Vec<u64>| {
        let body = json!({"salt": salt, "candidates": 2, "tokens": 20_000, "text": text,
                          "book": {"ttl_ms": 60_000}});
        let (status, answer) = daemon.json("POST", "/v2/salt", &body.to_string());
        assert_eq!(status, 200, "{answer}");
        answer["route"].clone()
    };
    let first = probe((1..=31).collect());
    assert_eq!(first["reason"], "new-salt", "{first}");
    let booked = first["booked"].as_str().unwrap().to_owned();
    let pending = || {
        let (_, all) = daemon.json("POST", "/v1/lookup", r#"{"keys":[]}"#);
        all["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == booked.as_str())
            .unwrap()["pending_prefill_tokens"]
            .as_u64()
            .unwrap()
    };
    wait_for("the first's booked prefill drained", || pending() == 0);
    // Half the document in common: about 10,000 of its tokens uncached, a second of
    // prefill queued where it follows the first.
    let sibling = probe((1..=15).chain(200..216).collect());
    assert_eq!(sibling["reason"], "salt-booked", "{sibling}");
    assert_eq!(sibling["candidates"][0]["endpoint"], booked.as_str());
    assert!(
        pending() > 0,
        "the sibling's uncached prefill is queued there"
    );
    let other = probe((1_000..1_031).collect());
    assert_eq!(other["reason"], "new-salt", "{other}");
    assert_ne!(other["candidates"][0]["endpoint"], booked.as_str());
    for answer in [&first, &sibling, &other] {
        for candidate in answer["candidates"].as_array().unwrap() {
            assert_eq!(candidate["matched_blocks"], 0, "{answer}");
        }
    }
    // Where a salt's requests went counts only while it is booked: after a 200 ms booking
    // that no event confirmed (its request failed, say), the same text goes by load.
    let short = |book: bool| {
        let mut body = json!({"salt": kvaffine_core::salt_tag("short"), "tokens": 2_000,
                              "text": (5_000..5_031).collect::<Vec<u64>>()});
        if book {
            body["book"] = json!({"ttl_ms": 200});
        }
        daemon.json("POST", "/v2/salt", &body.to_string()).1["route"].clone()
    };
    assert_eq!(short(true)["reason"], "new-salt");
    wait_for("the salt's booking expired", || {
        short(false)["reason"] == "new-salt"
    });
}

/// One daemon at its slot limit: 1,024 event streams from one process speaking for many
/// publishers (each with its own sockets, sequence and replay), every event applied, both
/// the replayed ones published before the daemon started and the live ones after, and
/// every stream's prefix found where it was stored; started with a soft limit of 1,024
/// open files, as many hosts start processes.
#[test]
fn one_daemon_follows_a_thousand_and_twenty_four_streams() {
    const STREAMS: usize = kvaffined::slots::MAX_SLOTS;
    // The publishers take about five descriptors each, past many hosts' soft limit.
    let limit = rlimit::increase_nofile_limit(u64::MAX).unwrap();
    assert!(
        limit >= 8 * STREAMS as u64,
        "this test needs {} open files; the hard limit is {limit}",
        8 * STREAMS
    );
    // A publisher takes four sockets; libzmq allows 1,023 per context.
    let contexts: Vec<zmq::Context> = (0..STREAMS / 128).map(|_| zmq::Context::new()).collect();
    let publishers: Vec<EventPublisher> = (0..STREAMS)
        .map(|i| publisher(&contexts[i / 128]))
        .collect();
    let name = |i: usize| format!("127.0.0.1:{}", 20_000 + i);
    let (first, second): (Vec<Vec<u32>>, Vec<Vec<u32>>) = (0..STREAMS as u32)
        .map(|i| (prompt(i, 2), prompt(i + 100_000, 3)))
        .unzip();
    for (p, tokens) in publishers.iter().zip(&first) {
        p.publish(&batch(vec![stored(tokens, 0, own)])).unwrap();
    }
    let flags: Vec<String> = publishers
        .iter()
        .enumerate()
        .flat_map(|(i, p)| ["--endpoint".to_owned(), endpoint_flag(&name(i), p)])
        .collect();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    // It needs about 7,300 open files: it raises the soft limit of 1,024 itself.
    let daemon = DaemonProcess::start_with_open_files(1024, &flags);
    // Generous: a slow machine starts a thousand streams' threads and replays slowly; the
    // bound only stops a hang.
    let wait = |what: &str, mut done: Box<dyn FnMut() -> bool + '_>| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
        while !done() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    let entries = |daemon: &DaemonProcess| -> Vec<u64> {
        let (_, value) = daemon.json("GET", "/v1/endpoints", "");
        value["endpoints"]
            .as_array()
            .map(|all| {
                all.iter()
                    .map(|e| e["index_entries"].as_u64().unwrap_or(0))
                    .collect()
            })
            .unwrap_or_default()
    };
    wait(
        "every stream's replayed blocks",
        Box::new(|| {
            let held = entries(&daemon);
            held.len() == STREAMS && held.iter().all(|n| *n == 2)
        }),
    );
    for (p, tokens) in publishers.iter().zip(&second) {
        p.publish(&batch(vec![stored(tokens, 0, own)])).unwrap();
    }
    wait(
        "every stream's live blocks",
        Box::new(|| entries(&daemon).iter().all(|n| *n == 5)),
    );
    for i in [0, 62, 63, 64, 500, STREAMS - 1] {
        let answer = daemon.lookup(&keys(&second[i]));
        assert_eq!(answer["ranked"][0], name(i), "stream {i}");
        assert_eq!(daemon.matched(&keys(&first[i]), &name(i)), 2, "stream {i}");
    }
    assert_eq!(
        daemon.metric("kvaffined_index_entries"),
        (STREAMS * 5) as f64
    );
}

/// Two daemons in front of the same replicas (two gateways), peered: one through `--peer`,
/// the other through its config file, written once both listen. A pick booked on either
/// is held by both: the other ranks its replica first for the booked prefix before any
/// event, with the booked blocks matched and its prefill pending there; what a daemon
/// takes from a peer it does not send on.
#[test]
fn peered_daemons_hold_each_others_bookings() {
    let ctx = zmq::Context::new();
    let (pa, pb) = (publisher(&ctx), publisher(&ctx));
    let dir = std::env::temp_dir().join(format!("kvaffined-peers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("first.json");
    std::fs::write(&config, r#"{"peers": []}"#).unwrap();
    let endpoints = [
        "--endpoint".to_owned(),
        endpoint_flag(A, &pa),
        "--endpoint".to_owned(),
        endpoint_flag(B, &pb),
        // A booked prefill stays pending for the whole test.
        "--prefill-tokens-per-second".to_owned(),
        "1".to_owned(),
    ];
    let with = |more: &[&str]| -> Vec<String> {
        endpoints
            .iter()
            .cloned()
            .chain(more.iter().map(|s| s.to_string()))
            .collect()
    };
    let first_args = with(&["--config", config.to_str().unwrap()]);
    let first = DaemonProcess::start(&first_args.iter().map(String::as_str).collect::<Vec<_>>());
    let second_args = with(&["--peer", &first.addr]);
    let second = DaemonProcess::start(&second_args.iter().map(String::as_str).collect::<Vec<_>>());
    std::fs::write(&config, json!({"peers": [second.addr]}).to_string()).unwrap();
    for daemon in [&first, &second] {
        daemon.wait_ready();
        wait_for("its peer", || daemon.metric("kvaffined_peers ") == 1.0);
    }
    let received = |daemon: &DaemonProcess| {
        daemon.metric("kvaffined_peer_bookings_total{outcome=\"received\"} ")
    };
    for (n, (booker, other)) in [(&first, &second), (&second, &first)]
        .into_iter()
        .enumerate()
    {
        let k = keys(&prompt(80 + n as u32, 6));
        let body = json!({"keys": k, "book": {"ttl_ms": 60_000}}).to_string();
        let (status, answer) = booker.json("POST", "/v1/lookup", &body);
        assert_eq!(status, 200, "{answer}");
        let booked = answer["booked"].as_str().unwrap().to_owned();
        wait_for("the booking at the peer", || received(other) == 1.0);
        let seen = other.lookup(&k);
        assert_eq!(seen["ranked"][0], booked.as_str(), "{seen}");
        assert_eq!(seen["reason"], "prefix");
        let entry = DaemonProcess::record(&seen, &booked);
        assert_eq!(entry["matched_blocks"], 6, "{entry}");
        assert_eq!(entry["indexed_blocks"], 0, "{entry}");
        // Another request waits behind the booked prefill there (the booked request's
        // own continuation would not: it needs that prefill wherever it goes).
        let behind = other.lookup(&keys(&prompt(90, 2)));
        let pending = DaemonProcess::record(&behind, &booked)["pending_prefill_tokens"]
            .as_u64()
            .unwrap();
        assert!(pending > 0, "{behind}");
    }
    // Both see the same queues: each pick counted once, wherever it was made.
    let pending = |daemon: &DaemonProcess| -> Vec<u64> {
        let answer = daemon.lookup(&keys(&prompt(91, 2)));
        [A, B]
            .iter()
            .map(|name| {
                DaemonProcess::record(&answer, name)["pending_prefill_tokens"]
                    .as_u64()
                    .unwrap()
            })
            .collect()
    };
    let (seen_first, seen_second) = (pending(&first), pending(&second));
    for (a, b) in seen_first.iter().zip(&seen_second) {
        assert!(
            a.abs_diff(*b) <= 1,
            "{seen_first:?} against {seen_second:?}"
        );
    }
    for daemon in [&first, &second] {
        assert_eq!(
            daemon.metric("kvaffined_peer_bookings_total{outcome=\"sent\"} "),
            1.0,
            "each sent its own booking, not the one it took"
        );
    }
    // A booking whose replica's events came first is done: skipped, not queued.
    let done = prompt(92, 3);
    pa.publish(&batch(vec![stored(&done, 0, own)])).unwrap();
    wait_for("A's blocks", || first.matched(&keys(&done), A) == 3);
    let late = json!({"bookings": [{"endpoint": A, "rank": 0, "work": 1000, "ttl_ms": 60_000,
        "held": {"blocks": {"keys": keys(&done), "windows": []}}}]});
    let before = pending(&first);
    let (status, _) = first.request("POST", "/v2/peer/bookings", &late.to_string());
    assert_eq!(status, 204);
    assert_eq!(
        first.metric("kvaffined_peer_bookings_total{outcome=\"already_stored\"} "),
        1.0
    );
    assert!(pending(&first)[0] <= before[0], "nothing queued on A");
    // A stream the daemon does not follow is counted and skipped; a bad body is refused.
    let stranger = json!({"bookings": [{"endpoint": "10.9.9.9:8000", "rank": 0, "work": 10,
        "ttl_ms": 1000, "held": {"salt": {"salt": 7}}}]});
    let (status, _) = first.request("POST", "/v2/peer/bookings", &stranger.to_string());
    assert_eq!(status, 204);
    assert_eq!(
        first.metric("kvaffined_peer_bookings_total{outcome=\"unknown_stream\"} "),
        1.0
    );
    let (status, _) = first.request("POST", "/v2/peer/bookings", r#"{"bookings": 3}"#);
    assert_eq!(status, 400);
    // A salt's first request routed by a probe: its salt booking and its text keys reach
    // the peer, which finds a sibling's text where the first went.
    let probe = json!({"salt": kvaffine_core::salt_tag("peered"), "tokens": 2_000,
                       "text": (1..=30).collect::<Vec<u64>>(), "book": {"ttl_ms": 60_000}});
    let before = received(&second);
    let (status, routed) = first.json("POST", "/v2/salt", &probe.to_string());
    assert_eq!(status, 200, "{routed}");
    assert_eq!(routed["route"]["reason"], "new-salt", "{routed}");
    let booked = routed["route"]["booked"].as_str().unwrap();
    wait_for("the salt's booking and its text at the peer", || {
        received(&second) >= before + 2.0
    });
    let sibling = json!({"keys": (1..=29).chain([99]).collect::<Vec<u64>>(), "approximate": true});
    let (status, seen) = second.json("POST", "/v1/lookup", &sibling.to_string());
    assert_eq!(status, 200, "{seen}");
    assert_eq!(
        DaemonProcess::record(&seen, booked)["matched_blocks"],
        29,
        "{seen}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_daemon_that_starts_takes_the_bookings_its_peers_hold() {
    let ctx = zmq::Context::new();
    let (pa, pb) = (publisher(&ctx), publisher(&ctx));
    let endpoints = [
        "--endpoint".to_owned(),
        endpoint_flag(A, &pa),
        "--endpoint".to_owned(),
        endpoint_flag(B, &pb),
    ];
    let args = |peers: &[&str]| -> Vec<String> {
        let mut args = endpoints.to_vec();
        for peer in peers {
            args.extend(["--peer".to_owned(), peer.to_string()]);
        }
        args
    };
    // The running daemon's peer is not up yet (its bookings to it fail): it still keeps
    // what it holds for a daemon that starts.
    let running_args = args(&["127.0.0.1:9"]);
    let running =
        DaemonProcess::start(&running_args.iter().map(String::as_str).collect::<Vec<_>>());
    running.wait_ready();
    let live = keys(&prompt(120, 6));
    let body = json!({"keys": live, "book": {"ttl_ms": 60_000}}).to_string();
    let (status, answer) = running.json("POST", "/v1/lookup", &body);
    assert_eq!(status, 200, "{answer}");
    let booked = answer["booked"].as_str().unwrap().to_owned();
    let gone = keys(&prompt(121, 4));
    let body = json!({"keys": gone, "book": {"ttl_ms": 1}}).to_string();
    assert_eq!(running.json("POST", "/v1/lookup", &body).0, 200);
    std::thread::sleep(std::time::Duration::from_millis(5));
    // What it hands a peer: the live booking, with what is left of its TTL and no work.
    let (status, held) = running.json("GET", "/v2/peer/bookings", "");
    assert_eq!(status, 200, "{held}");
    let held = held["bookings"].as_array().unwrap().clone();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0]["endpoint"], booked.as_str());
    assert_eq!(held[0]["work"], 0);
    let ttl = held[0]["ttl_ms"].as_u64().unwrap();
    assert!(ttl > 50_000 && ttl <= 60_000, "{ttl}");
    // A daemon that starts beside it takes the booking before any event, passing over a
    // peer that does not answer; its first lookup, sent as soon as it listens, waits for
    // that.
    let starting_args = args(&["127.0.0.1:9", &running.addr]);
    let starting =
        DaemonProcess::start(&starting_args.iter().map(String::as_str).collect::<Vec<_>>());
    let seen = starting.lookup(&live);
    assert_eq!(
        starting.metric("kvaffined_peer_bookings_total{outcome=\"restored\"} "),
        1.0
    );
    assert_eq!(seen["ranked"][0], booked.as_str(), "{seen}");
    assert_eq!(seen["reason"], "prefix", "{seen}");
    let entry = DaemonProcess::record(&seen, &booked);
    assert_eq!(entry["matched_blocks"], 6, "{entry}");
    assert_eq!(entry["indexed_blocks"], 0, "{entry}");
    let expired = starting.lookup(&gone);
    for name in [A, B] {
        assert_eq!(
            DaemonProcess::record(&expired, name)["matched_blocks"],
            0,
            "{expired}"
        );
    }
    // What it took is held, not sent back.
    assert_eq!(
        running.metric("kvaffined_peer_bookings_total{outcome=\"received\"} "),
        0.0
    );
}

#[test]
fn a_prefix_other_lookups_want_leaves_its_queue_for_an_idle_replica_sooner() {
    let ctx = zmq::Context::new();
    let (pa, pb) = (publisher(&ctx), publisher(&ctx));
    // A holds a 21-block prompt; B nothing; both answer their scrapes (empty: idle).
    // Booked picks stay pending (1 token/s, never saturating).
    let ((a, _), (b, _)) = (scrape_recorder(), scrape_recorder());
    let shared = prompt(140, 21);
    pa.publish(&batch(vec![stored(&shared, 0, own)])).unwrap();
    let daemon = DaemonProcess::start(&[
        "--endpoint",
        &endpoint_flag(&a, &pa),
        "--endpoint",
        &endpoint_flag(&b, &pb),
        "--prefill-tokens-per-second",
        "1",
        "--request-overhead-tokens",
        "0",
        "--max-pending-prefill-tokens",
        "1000000",
    ]);
    daemon.wait_ready();
    // Requests of that prompt and a block of their own: 1 cold block and 21 cached (3.1
    // blocks of work) on A, against 22 cold blocks on B. Each pick on A queues 3.1 blocks.
    // Counting the queue once and the request's own work twice, A wins while its queue is
    // under 37.8 blocks (13 picks); counting the queue twice and the work once, as from
    // the third lookup ending at the same key, under 9.45 blocks (4 picks).
    let mut went = Vec::new();
    for n in 0..5 {
        let mut request = shared.clone();
        request.extend(prompt(150 + n, 1));
        let body = json!({"keys": keys(&request), "book": {"ttl_ms": 60_000}}).to_string();
        let (status, answer) = daemon.json("POST", "/v1/lookup", &body);
        assert_eq!(status, 200, "{answer}");
        went.push((
            answer["booked"].as_str().unwrap().to_owned(),
            answer["reason"].clone(),
        ));
    }
    let expected: Vec<(String, serde_json::Value)> = [&a, &a, &a, &a, &b]
        .iter()
        .zip(["prefix", "prefix", "prefix", "prefix", "saturated"])
        .map(|(e, r)| (e.to_string(), json!(r)))
        .collect();
    assert_eq!(went, expected);
    assert_eq!(daemon.metric("kvaffined_shared_prefix_lookups_total "), 3.0);
    // A conversation's own turns end further on each time: never shared.
    let mut history = prompt(160, 2);
    for turn in 0..4 {
        let body = json!({"keys": keys(&history), "book": {"ttl_ms": 60_000}}).to_string();
        assert_eq!(
            daemon.json("POST", "/v1/lookup", &body).0,
            200,
            "turn {turn}"
        );
        history.extend(prompt(170 + turn, 1));
    }
    assert_eq!(daemon.metric("kvaffined_shared_prefix_lookups_total "), 3.0);
}

#[test]
fn peers_named_by_dns_share_bookings_and_a_daemon_among_its_peers_leaves_itself_out() {
    let ctx = zmq::Context::new();
    let (pa, pb) = (publisher(&ctx), publisher(&ctx));
    let dir = std::env::temp_dir().join(format!("kvaffined-peer-dns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("starting.json");
    std::fs::write(&config, r#"{"peers": []}"#).unwrap();
    let with = |more: &[&str]| -> Vec<String> {
        [
            "--endpoint",
            &endpoint_flag(A, &pa),
            "--endpoint",
            &endpoint_flag(B, &pb),
        ]
        .into_iter()
        .chain(more.iter().copied())
        .map(str::to_owned)
        .collect()
    };
    let start = |args: Vec<String>| {
        DaemonProcess::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let port = |daemon: &DaemonProcess| daemon.addr.rsplit_once(':').unwrap().1.to_owned();
    let received = |daemon: &DaemonProcess| {
        daemon.metric("kvaffined_peer_bookings_total{outcome=\"received\"} ")
    };
    let book = |daemon: &DaemonProcess, keys: &[u64]| -> String {
        let body = json!({"keys": keys, "book": {"ttl_ms": 60_000}}).to_string();
        let (status, answer) = daemon.json("POST", "/v1/lookup", &body);
        assert_eq!(status, 200, "{answer}");
        answer["booked"].as_str().unwrap().to_owned()
    };
    // The running daemon's only peer never answers: it still keeps its bookings.
    let running = start(with(&["--peer", "127.0.0.1:9"]));
    running.wait_ready();
    let before = keys(&prompt(130, 5));
    let booked_before = book(&running, &before);
    // A daemon that starts names it by a DNS name (the system's resolver answers
    // 127.0.0.1, not the address it printed as such): it takes what the running one holds.
    let starting = start(with(&[
        "--peer-dns",
        &format!("localhost:{}", port(&running)),
        "--config",
        config.to_str().unwrap(),
    ]));
    starting.wait_ready();
    wait_for("the restored booking", || {
        starting.metric("kvaffined_peer_bookings_total{outcome=\"restored\"} ") == 1.0
    });
    let seen = starting.lookup(&before);
    assert_eq!(seen["ranked"][0], booked_before.as_str(), "{seen}");
    assert_eq!(
        DaemonProcess::record(&seen, &booked_before)["matched_blocks"],
        5
    );
    assert_eq!(starting.metric("kvaffined_peers "), 1.0);
    // Its bookings reach the running daemon through the name.
    let first = keys(&prompt(131, 6));
    let booked = book(&starting, &first);
    wait_for("the booking at the named peer", || {
        received(&running) == 1.0
    });
    let entry = DaemonProcess::record(&running.lookup(&first), &booked);
    assert_eq!(entry["matched_blocks"], 6, "{entry}");
    assert_eq!(entry["indexed_blocks"], 0, "{entry}");
    // Now its peers name it too (as a DNS name of every gateway pod would), by a name it
    // does not listen on: it finds itself on its first booking and leaves itself out.
    let itself = format!("localhost:{}", port(&starting));
    std::fs::write(&config, json!({"peers": [itself]}).to_string()).unwrap();
    wait_for("itself among its peers", || {
        starting.metric("kvaffined_peers ") == 2.0
    });
    book(&starting, &keys(&prompt(132, 4)));
    wait_for("the second booking at the peer", || {
        received(&running) == 2.0
    });
    wait_for("itself left out", || {
        starting.metric("kvaffined_peers ") == 1.0
    });
    assert_eq!(received(&starting), 0.0, "it held its own booking twice");
    assert_eq!(
        starting.metric("kvaffined_peer_bookings_total{outcome=\"sent\"} "),
        2.0
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A replica's HTTP server that only notes when `/metrics` is asked (milliseconds of the
/// wall clock) and answers every request with an empty 200.
fn scrape_recorder() -> (String, std::sync::Arc<std::sync::Mutex<Vec<f64>>>) {
    use std::io::{BufRead, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let noted = asked.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let noted = noted.clone();
            std::thread::spawn(move || {
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    if line.starts_with("GET /metrics") {
                        noted.lock().unwrap().push(now_ms());
                    }
                    loop {
                        let mut header = String::new();
                        if reader.read_line(&mut header).unwrap_or(0) == 0 {
                            return;
                        }
                        if header.trim_end().is_empty() {
                            break;
                        }
                    }
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                    if writer.write_all(answer).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, asked)
}

fn now_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        * 1e3
}

/// `ms` into a period of `period` ms, relative to `origin`'s place in it, in
/// (-period / 2, period / 2].
fn phase(ms: f64, origin: f64, period: f64) -> f64 {
    let d = (ms - origin).rem_euclid(period);
    if d > period / 2.0 { d - period } else { d }
}

/// Two daemons with `args` following `replica` one after the other, the second started
/// half an interval later in the period than the first: how far apart in the period their
/// first scrapes (at once when followed) and their periodic ones fell.
fn scrape_phases_apart(
    replica: &str,
    asked: &std::sync::Mutex<Vec<f64>>,
    interval_ms: f64,
    args: &[&str],
) -> (f64, f64) {
    // (when it was started, its first scrape, the median of its next ones' phases).
    let mut runs: Vec<(f64, f64, f64)> = Vec::new();
    for _ in 0..2 {
        if let Some(&(started, _, _)) = runs.first() {
            let wait = (started + interval_ms / 2.0 - now_ms()).rem_euclid(interval_ms);
            std::thread::sleep(std::time::Duration::from_secs_f64(wait / 1e3));
        }
        asked.lock().unwrap().clear();
        let started = now_ms();
        let daemon = DaemonProcess::start(args);
        wait_for("a scrape at once and four at its phase", || {
            asked.lock().unwrap().len() >= 5
        });
        drop(daemon);
        let times = asked.lock().unwrap().clone();
        // Relative to its own first periodic scrape, so that none wraps around the period.
        let origin = times[1];
        let mut phases: Vec<f64> = times[1..5]
            .iter()
            .map(|&t| phase(t, origin, interval_ms))
            .collect();
        phases.sort_by(f64::total_cmp);
        let median = (phases[1] + phases[2]) / 2.0;
        for p in &phases {
            assert!(
                (p - median).abs() < interval_ms / 10.0,
                "{replica}: a scrape off its phase: {phases:?}"
            );
        }
        runs.push((started, times[0], origin + median));
    }
    let (first, second) = (runs[0], runs[1]);
    (
        phase(second.1, first.1, interval_ms),
        phase(second.2, first.2, interval_ms),
    )
}

/// A daemon with peers scrapes a replica at a phase of the wall clock that the replica's
/// address fixes, whenever it started: peered daemons, or one restarted, see the same
/// requests finish between two scrapes and learn the same prefill speeds. One without
/// keeps the phase of when it began: daemons that do not share their picks then do not
/// read the same loads at the same instants and move sessions together
/// (`docs/daemon.md`, several gateways).
#[test]
fn peered_daemons_scrape_a_replica_at_the_same_phase_of_the_wall_clock() {
    const INTERVAL_MS: f64 = 400.0;
    let interval = INTERVAL_MS.to_string();
    let ctx = zmq::Context::new();
    let events = publisher(&ctx);
    for peered in [true, false] {
        let (replica, asked) = scrape_recorder();
        let flag = endpoint_flag(&replica, &events);
        let mut args = vec!["--endpoint", &flag, "--scrape-interval-ms", &interval];
        if peered {
            // A peer that never answers: only its being named counts here.
            args.extend(["--peer", "127.0.0.1:9"]);
        }
        let (first, periodic) = scrape_phases_apart(&replica, &asked, INTERVAL_MS, &args);
        assert!(
            first.abs() > INTERVAL_MS / 4.0,
            "the daemons' first scrapes fell {first:.0} ms apart in the period"
        );
        if peered {
            assert!(
                periodic.abs() < INTERVAL_MS / 10.0,
                "peered, the second daemon scraped {periodic:.0} ms off the first's phase"
            );
        } else {
            assert!(
                periodic.abs() > INTERVAL_MS / 4.0,
                "unpeered, the second daemon scraped {periodic:.0} ms off the first's phase"
            );
        }
    }
}
