//! What the daemon's benches share: a counting allocator, a fast random source, timing
//! percentiles, the daemon settings they run with, and running the sections asked for.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::time::Duration;

use kvaffine_core::events::{EventFormat, encode_batch};
use kvaffine_core::{HashAlgo, KeyConfig, VllmCompat};
use kvaffined::config::{EndpointSpec, Settings};
use kvaffined::index::Slot;
use kvaffined::metrics::EndpointLabel;
use kvaffined::state::{Endpoint, EndpointStatus, ScrapedLoad};
use parking_lot::Mutex;

pub const BLOCK_SIZE: usize = 64;

/// Counts live heap bytes, so index memory is measured, not estimated.
pub struct Counting;

pub static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: defers every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

pub fn settings() -> Settings {
    Settings {
        hash_seed: None,
        keys: KeyConfig::new(HashAlgo::Sha256Cbor, BLOCK_SIZE, None, VllmCompat::V0_31).unwrap(),
        policy: Default::default(),
        topic: String::new(),
        lora_paths: Default::default(),
        max_keys: 16_384,
        max_inflight_lookups: 1024,
        max_entries: 100_000_000,
        max_event_message_bytes: 64 << 20,
        booking_ttl: Duration::from_secs(2),
        // Every pick booked, as the concurrency row says: no bound.
        max_booked_keys: usize::MAX,
        scrape_interval: Duration::from_millis(500),
        speed_flags: Default::default(),
        replay_timeout: Duration::from_secs(5),
    }
}

/// Endpoint `n` of a fleet, synced, aligned and scraped (`n` requests running), at
/// 10.0.x.y:8000.
pub fn endpoint(n: usize) -> Arc<Endpoint> {
    let name = format!("10.0.{}.{}:8000", n / 256, n % 256);
    Arc::new(Endpoint {
        spec: EndpointSpec {
            endpoint: name.clone(),
            events: format!("tcp://10.0.{}.{}:5557", n / 256, n % 256),
            replay: None,
            rank: 0,
        },
        slot: Slot::new(n).unwrap(),
        label: EndpointLabel { endpoint: name },
        status: Mutex::new(EndpointStatus {
            synced: true,
            alignment: "aligned",
            load: Some(ScrapedLoad {
                running: n as u32,
                waiting: 0,
                kv_cache_usage: 0.5,
            }),
            ..EndpointStatus::default()
        }),
        stop: AtomicBool::new(true),
        ingest: Mutex::new(None),
    })
}

/// `batches` encoded batches of 8 new prompts x 8 64-token blocks, as a replica publishes
/// them (the same every run).
pub fn payloads(keys: &KeyConfig, batches: usize) -> Vec<Vec<u8>> {
    let mut rng = Rng(77);
    (0..batches)
        .map(|b| {
            let events = (0..8)
                .map(|_| {
                    let tokens: Vec<u32> = (0..8 * BLOCK_SIZE)
                        .map(|_| (rng.next() % 151_936) as u32)
                        .collect();
                    vllm_emu::publisher::stored_prompt(keys, tokens)
                })
                .collect();
            encode_batch(
                &vllm_emu::publisher::batch_of(events, b as f64),
                EventFormat::Map,
            )
        })
        .collect()
}

/// One part of a bench's report: appends its rows.
pub type Section = fn(&mut String);

/// Runs the `sections` named on the command line (`cargo bench -p kvaffined --bench NAME
/// -- SECTION...`; `cargo bench` itself passes `--bench`), all of them by default, and
/// prints what they wrote after `header`.
pub fn run_sections(header: &str, sections: &[(&str, Section)]) {
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with("--"))
        .collect();
    let mut out = header.to_owned();
    for (name, section) in sections {
        if only.is_empty() || only.iter().any(|o| o == name) {
            section(&mut out);
        }
    }
    println!("{out}");
}
