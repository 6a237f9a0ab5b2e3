//! The daemon's speed and size: in-process lookups over 1 M indexed blocks on 8
//! endpoints, HTTP lookups over loopback at 1k req/s, ingest (decode + apply) rate, and
//! index bytes per (block, endpoint) entry at 10 M entries. Run with
//! `cargo xtask bench daemon`, which writes `docs/benchmarks/daemon.md`.
//!
//! Percentiles come from timing every operation (criterion reports means and medians,
//! not p99), so this is a plain binary.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvaffine_core::BlockKey;
use kvaffine_core::events::decode_batch;
use kvaffine_core::protocol::{Booking, LookupRequest, Query};
use kvaffine_core::{HashAlgo, KeyConfig, VllmCompat};
use kvaffined::hybrid::Rule;
use kvaffined::index::{GPU, PrefixIndex, Slot};
use kvaffined::ingest::Applier;
use kvaffined::state::Daemon;

mod common;

#[global_allocator]
static ALLOCATOR: common::Counting = common::Counting;
use common::{BLOCK_SIZE, LIVE, Rng, endpoint, percentile, settings, us};

const ENDPOINTS: usize = 8;
const KEYS_PER_LOOKUP: usize = 128;

/// 1 M blocks: chains of 128 keys, each chain on one endpoint.
fn fill(index: &mut PrefixIndex, rng: &mut Rng, blocks: usize) -> Vec<Vec<u64>> {
    let mut chains = Vec::new();
    for c in 0..blocks / KEYS_PER_LOOKUP {
        let chain: Vec<u64> = (0..KEYS_PER_LOOKUP).map(|_| rng.next()).collect();
        index.store(Slot::new(c % ENDPOINTS).unwrap(), GPU, 0, &chain);
        chains.push(chain);
    }
    chains
}

fn daemon_with_index(rng: &mut Rng) -> (Arc<Daemon>, Vec<Vec<u64>>) {
    let daemon = Arc::new(Daemon::new(settings()));
    let chains = fill(&mut daemon.index.write(), rng, 1_000_000);
    for n in 0..ENDPOINTS {
        Arc::make_mut(&mut daemon.endpoints.write()).push(endpoint(n));
    }
    (daemon, chains)
}

fn lookup_of(keys: &[u64], book: bool) -> LookupRequest {
    LookupRequest {
        query: Query::Blocks(keys.iter().copied().map(BlockKey).collect()),
        model: None,
        book: book.then(Booking::default),
        candidates: 2,
    }
}

fn lookups(out: &mut String) {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let (daemon, chains) = daemon_with_index(&mut rng);
    let index = daemon.index.read();
    let mut row = |name: &str, make: &mut dyn FnMut(usize) -> Vec<u64>| {
        let queries: Vec<Vec<u64>> = (0..50_000).map(&mut *make).collect();
        let mut times: Vec<Duration> = Vec::with_capacity(queries.len());
        let mut sink = 0u32;
        for q in &queries {
            let start = Instant::now();
            sink ^= index.longest_prefixes(GPU, 0, q).get(0);
            times.push(start.elapsed());
        }
        std::hint::black_box(sink);
        times.sort();
        out.push_str(&format!(
            "| index walk, {name} | {:.2} us | {:.2} us |\n",
            us(percentile(&times, 0.5)),
            us(percentile(&times, 0.99))
        ));
    };
    row("full hit", &mut |i| chains[i % chains.len()].clone());
    row("half hit", &mut |i| {
        let mut q = chains[i % chains.len()][..64].to_vec();
        q.extend((0..64).map(|k| k as u64 ^ 0xabc));
        q
    });
    row("miss", &mut |i| {
        (0..KEYS_PER_LOOKUP as u64)
            .map(|k| k * 31 + i as u64)
            .collect()
    });
    drop(index);
    let mut times = Vec::new();
    for i in 0..50_000 {
        let request = lookup_of(&chains[i % chains.len()], false);
        let start = Instant::now();
        std::hint::black_box(daemon.lookup(&request, Instant::now()));
        times.push(start.elapsed());
    }
    times.sort();
    out.push_str(&format!(
        "| whole lookup answer (8 endpoints, ranking, no HTTP) | {:.2} us | {:.2} us |\n",
        us(percentile(&times, 0.5)),
        us(percentile(&times, 0.99))
    ));
    hybrid_lookups(&daemon, &chains, out);
}

/// The same endpoints as hybrid-attention replicas: every chain in a full-attention group
/// 1, and in a sliding-window group 0 only the window before its end (2 blocks of 64, a
/// 128-token window), as vLLM keeps it. A full hit finds the window at once; a sibling
/// branching at block 64 scans back 64 blocks and finds none (vLLM serves it nothing).
fn hybrid_lookups(daemon: &Daemon, chains: &[Vec<u64>], out: &mut String) {
    {
        let mut index = daemon.index.write();
        for (c, chain) in chains.iter().enumerate() {
            let slot = Slot::new(c % ENDPOINTS).unwrap();
            index.store(slot, GPU, 1, chain);
            index.store(slot, GPU, 0, &chain[KEYS_PER_LOOKUP - 2..]);
        }
    }
    for endpoint in daemon.endpoints.read().iter() {
        endpoint.status.lock().rule = Arc::new(Rule::Hybrid {
            full: vec![1],
            windows: vec![(0, 2)],
        });
    }
    let mut row = |name: &str, make: &dyn Fn(usize) -> Vec<u64>| {
        let mut times = Vec::new();
        for i in 0..50_000 {
            let request = lookup_of(&make(i), false);
            let start = Instant::now();
            std::hint::black_box(daemon.lookup(&request, Instant::now()));
            times.push(start.elapsed());
        }
        times.sort();
        out.push_str(&format!(
            "| whole lookup answer, 8 hybrid endpoints, {name} | {:.2} us | {:.2} us |\n",
            us(percentile(&times, 0.5)),
            us(percentile(&times, 0.99))
        ));
    };
    row("full hit", &|i| chains[i % chains.len()].clone());
    row("sibling branching at block 64", &|i| {
        let mut q = chains[i % chains.len()][..64].to_vec();
        q.extend((0..64).map(|k| k as u64 ^ 0xabc));
        q
    });
}

/// Lookups per second from `callers` threads at once, each booking its pick if `book`, for
/// one second: whether lookups run side by side or queue on a lock.
fn concurrent_rate(
    daemon: &Arc<Daemon>,
    chains: &Arc<Vec<Vec<u64>>>,
    callers: usize,
    book: bool,
) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let threads: Vec<_> = (0..callers)
        .map(|caller| {
            let (daemon, chains, stop) = (daemon.clone(), chains.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut done = 0u64;
                let mut i = caller * 7919;
                while !stop.load(Ordering::Relaxed) {
                    let request = lookup_of(&chains[i % chains.len()], book);
                    std::hint::black_box(daemon.lookup(&request, Instant::now()));
                    done += 1;
                    i += 1;
                }
                done
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    total as f64 / started.elapsed().as_secs_f64()
}

fn concurrent(out: &mut String) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (daemon, chains) = daemon_with_index(&mut rng);
    let chains = Arc::new(chains);
    out.push_str("\n| whole lookups from concurrent callers (128 keys, 8 endpoints, no HTTP) | 1 caller | 2 callers | 2 / 1 |\n|---|---|---|---|\n");
    for book in [false, true] {
        let one = concurrent_rate(&daemon, &chains, 1, book);
        let two = concurrent_rate(&daemon, &chains, 2, book);
        out.push_str(&format!(
            "| {} | {:.0} k/s | {:.0} k/s | {:.2} |\n",
            if book {
                "each pick booked"
            } else {
                "read only"
            },
            one / 1e3,
            two / 1e3,
            two / one
        ));
    }
}

fn http(out: &mut String) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (daemon, chains) = daemon_with_index(&mut rng);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (p50, p99, sent) = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(listener, kvaffined::http::router(daemon))
                .await
                .unwrap();
        });
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let url = format!("http://{addr}/v2/lookup");
        let bodies: Vec<String> = chains
            .iter()
            .take(1000)
            .map(|c| serde_json::json!({ "blocks": c, "candidates": 2 }).to_string())
            .collect();
        // Warm the connection pool.
        for body in bodies.iter().take(50) {
            client.post(&url).body(body.clone()).send().await.unwrap();
        }
        // Open loop: one request every millisecond for 10 s, whatever the answers do.
        let mut ticker = tokio::time::interval(Duration::from_millis(1));
        let mut tasks = Vec::new();
        for i in 0..10_000 {
            ticker.tick().await;
            let (client, url, body) = (
                client.clone(),
                url.clone(),
                bodies[i % bodies.len()].clone(),
            );
            tasks.push(tokio::spawn(async move {
                let start = Instant::now();
                let response = client.post(&url).body(body).send().await.unwrap();
                assert!(response.status().is_success());
                response.bytes().await.unwrap();
                start.elapsed()
            }));
        }
        let mut times = Vec::new();
        for task in tasks {
            times.push(task.await.unwrap());
        }
        times.sort();
        (
            percentile(&times, 0.5),
            percentile(&times, 0.99),
            times.len(),
        )
    });
    out.push_str(&format!(
        "| HTTP lookup, 128 keys, 1k req/s open loop, loopback ({sent} requests) | {:.0} us | {:.0} us |\n",
        us(p50),
        us(p99)
    ));
}

fn ingest(out: &mut String) {
    let keys = KeyConfig::new(HashAlgo::Sha256Cbor, BLOCK_SIZE, None, VllmCompat::V0_31).unwrap();
    // 4,000 batches of 8 prompts x 8 new 64-token blocks, as a replica publishes them.
    let payloads = common::payloads(&keys, 4000);
    let blocks = 4000 * 8 * 8;
    let mut rates = Vec::new();
    for _ in 0..5 {
        let mut index = PrefixIndex::new(usize::MAX);
        let mut applier = Applier::new(Slot::new(0).unwrap(), keys.clone(), Default::default());
        let start = Instant::now();
        for payload in &payloads {
            let batch = decode_batch(payload).unwrap();
            applier.apply(&batch, &mut index);
        }
        rates.push(blocks as f64 / start.elapsed().as_secs_f64());
        assert_eq!(index.entries(), blocks);
    }
    rates.sort_by(f64::total_cmp);
    out.push_str(&format!(
        "\n| ingest: decode + apply on one thread ({blocks} 64-token block entries, aligned endpoint, median of 5) | {:.2} M block entries/s |\n|---|---|\n",
        rates[2] / 1e6
    ));
}

fn memory(out: &mut String) {
    out.push_str("\n| index memory at 10 M (block, endpoint) entries | heap bytes / entry | table estimate / entry |\n|---|---|---|\n");
    for (name, copies) in [
        ("every block on 1 endpoint", 1usize),
        ("every block on 2 of 8 endpoints", 2),
    ] {
        let mut rng = Rng(5);
        let before = LIVE.load(Ordering::Relaxed);
        let mut index = PrefixIndex::new(usize::MAX);
        let entries = 10_000_000;
        let mut chunk = Vec::with_capacity(1024);
        let mut slot = 0;
        while index.entries() < entries {
            chunk.clear();
            chunk.extend((0..1024).map(|_| rng.next()));
            for c in 0..copies {
                index.store(Slot::new((slot + c) % ENDPOINTS).unwrap(), GPU, 0, &chunk);
            }
            slot += 1;
        }
        let bytes = (LIVE.load(Ordering::Relaxed) - before) as f64;
        out.push_str(&format!(
            "| {name} | {:.1} | {:.1} |\n",
            bytes / index.entries() as f64,
            index.table_bytes() as f64 / index.entries() as f64
        ));
        drop(index);
    }
}

/// Heap bytes per booked key at the default `--max-booked-keys`, in bookings of 128 keys on
/// 8 endpoints.
fn booking_memory(out: &mut String) {
    let mut rng = Rng(9);
    let before = LIVE.load(Ordering::Relaxed);
    let mut bookings = kvaffined::bookings::Bookings::new(1_000_000);
    let expires = Instant::now() + Duration::from_secs(60);
    let mut booked = 0usize;
    let mut n = 0;
    while booked + KEYS_PER_LOOKUP <= 1_000_000 {
        let keys: Vec<BlockKey> = (0..KEYS_PER_LOOKUP).map(|_| BlockKey(rng.next())).collect();
        assert!(bookings.book(Slot::new(n % ENDPOINTS).unwrap(), &keys, &[], expires));
        booked += keys.len();
        n += 1;
    }
    let bytes = (LIVE.load(Ordering::Relaxed) - before) as f64;
    out.push_str(&format!(
        "\n| bookings at {booked} booked keys ({n} picks of {KEYS_PER_LOOKUP}) | heap bytes / key |\n|---|---|\n| distinct keys | {:.1} |\n",
        bytes / booked as f64
    ));
    drop(bookings);
}

fn main() {
    common::run_sections(
        "| what | p50 | p99 |\n|---|---|---|\n",
        &[
            ("lookups", lookups),
            ("http", http),
            ("ingest", ingest),
            ("memory", memory),
            ("booking_memory", booking_memory),
            ("concurrent", concurrent),
        ],
    );
}
