//! Core throughput: block keys and the tokenizer answer's scan, natively and in wasm
//! (wasmtime, Cranelift: the same class of JIT as Envoy's V8), and KV-event
//! decoding. Run with `cargo xtask bench core`, which
//! builds the wasm kernel, runs this, and writes `docs/benchmarks/core.md`.

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvaffine_core::events::{
    BlockStored, EngineHash, EventBatch, EventFormat, KvEvent, decode_batch, encode_batch,
};
use kvaffine_wasm_kernel::{
    checksum, key_tokens, scan_answer, sha256_only, tokenize_answer, tokens,
};
use wasmtime::{Engine, Instance, Linker, Module, Store, TypedFunc};

/// An 8k-token prompt, the size the filter's budget is set for.
const PROMPT_TOKENS: usize = 8192;
const BLOCK_SIZE: u32 = 64;

/// The kernel's timed exports: full keying, SHA-256 alone, and the answer's scan.
struct WasmKernel {
    store: Store<()>,
    keys: TypedFunc<(u32, u32), u64>,
    sha256_only: TypedFunc<(u32, u32), u64>,
    scan: TypedFunc<u32, u64>,
}

/// A `/tokenize` answer as serde reads it into a typed list: the parse the scan stands in
/// for.
#[derive(serde::Deserialize)]
struct Answer {
    tokens: Vec<u32>,
}

fn wasm_kernel() -> WasmKernel {
    let path = std::env::var("KVAFFINE_WASM_KERNEL")
        .expect("KVAFFINE_WASM_KERNEL names the wasm kernel; run `cargo xtask bench core`");
    let engine = Engine::default();
    let module = Module::from_file(&engine, &path).expect("wasm kernel loads");
    let mut linker = Linker::new(&engine);
    // The kernel never calls WASI; std merely links the imports.
    linker
        .define_unknown_imports_as_traps(&module)
        .expect("stub imports");
    let mut store = Store::new(&engine, ());
    let instance: Instance = linker
        .instantiate(&mut store, &module)
        .expect("instantiate");
    if let Ok(init) = instance.get_typed_func::<(), ()>(&mut store, "_initialize") {
        init.call(&mut store, ()).expect("_initialize");
    }
    let fill = instance
        .get_typed_func::<u32, ()>(&mut store, "kernel_fill_tokens")
        .expect("fill export");
    fill.call(&mut store, PROMPT_TOKENS as u32).expect("fill");
    let keys = instance
        .get_typed_func::<(u32, u32), u64>(&mut store, "kernel_key_tokens")
        .expect("keys export");
    let sha256_only = instance
        .get_typed_func::<(u32, u32), u64>(&mut store, "kernel_sha256_only")
        .expect("sha256 export");
    let scan = instance
        .get_typed_func::<u32, u64>(&mut store, "kernel_scan_answer")
        .expect("scan export");
    WasmKernel {
        store,
        keys,
        sha256_only,
        scan,
    }
}

/// Times one call of a kernel export that repeats its work `iters` times.
fn time_wasm(iters: u64, call: impl FnOnce(u32) -> u64) -> Duration {
    let start = Instant::now();
    std::hint::black_box(call(iters as u32));
    start.elapsed()
}

fn keys(c: &mut Criterion) {
    let prompt = tokens(PROMPT_TOKENS);
    let WasmKernel {
        mut store,
        keys: wasm_keys,
        sha256_only: wasm_sha256,
        ..
    } = wasm_kernel();
    let native = key_tokens(&prompt, BLOCK_SIZE as usize, 1);
    let in_wasm = wasm_keys
        .call(&mut store, (BLOCK_SIZE, 1))
        .expect("wasm call");
    assert_eq!(native, in_wasm, "native and wasm keys differ");

    let mut group = c.benchmark_group("keys");
    group.throughput(Throughput::Elements(PROMPT_TOKENS as u64));
    group.bench_function("native", |b| {
        b.iter(|| key_tokens(std::hint::black_box(&prompt), BLOCK_SIZE as usize, 1))
    });
    group.bench_function("wasm", |b| {
        b.iter_custom(|iters| {
            time_wasm(iters, |reps| {
                wasm_keys
                    .call(&mut store, (BLOCK_SIZE, reps))
                    .expect("wasm call")
            })
        })
    });
    group.bench_function("native_sha256_only", |b| {
        b.iter(|| sha256_only(std::hint::black_box(&prompt), BLOCK_SIZE as usize, 1))
    });
    group.bench_function("wasm_sha256_only", |b| {
        b.iter_custom(|iters| {
            time_wasm(iters, |reps| {
                wasm_sha256
                    .call(&mut store, (BLOCK_SIZE, reps))
                    .expect("wasm call")
            })
        })
    });
    group.finish();
}

/// The token list read out of an 8k-token `/tokenize` answer, as the filter reads it
/// (natively and in wasm), beside serde reading the same answer into a typed list.
fn scan(c: &mut Criterion) {
    let prompt = tokens(PROMPT_TOKENS);
    let answer = tokenize_answer(&prompt);
    let WasmKernel {
        mut store,
        scan: wasm_scan,
        ..
    } = wasm_kernel();
    assert_eq!(
        kvaffine_core::tokens::token_list(&answer).as_deref(),
        Some(prompt.as_slice()),
        "the scan reads other tokens"
    );
    let by_serde = serde_json::from_slice::<Answer>(&answer).expect("serde reads the answer");
    assert_eq!(by_serde.tokens, prompt, "serde reads other tokens");
    let native = scan_answer(&answer, 1);
    let in_wasm = wasm_scan.call(&mut store, 1).expect("wasm call");
    assert_eq!(native, in_wasm, "native and wasm scans differ");

    let mut group = c.benchmark_group("scan");
    group.throughput(Throughput::Elements(PROMPT_TOKENS as u64));
    group.bench_function("native", |b| {
        b.iter(|| scan_answer(std::hint::black_box(&answer), 1))
    });
    group.bench_function("wasm", |b| {
        b.iter_custom(|iters| {
            time_wasm(iters, |reps| {
                wasm_scan.call(&mut store, reps).expect("wasm call")
            })
        })
    });
    group.bench_function("native_serde", |b| {
        b.iter(|| {
            serde_json::from_slice::<Answer>(std::hint::black_box(&answer))
                .map(|a| checksum(&a.tokens))
                .unwrap_or(0)
        })
    });
    group.finish();
}

/// A batch as a busy replica publishes it: `events` BlockStored events of `blocks` 64-token
/// blocks each, u64 hashes, map layout.
fn busy_batch(events: usize, blocks: usize) -> Vec<u8> {
    let prompt = tokens(events * blocks * BLOCK_SIZE as usize);
    let mut hash = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        hash = hash
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        EngineHash::Int(hash)
    };
    let batch = EventBatch {
        ts: 1_767_225_600.25,
        events: prompt
            .chunks(blocks * BLOCK_SIZE as usize)
            .map(|chunk| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes: (0..blocks).map(|_| next()).collect(),
                    parent_block_hash: Some(next()),
                    token_ids: chunk.to_vec(),
                    block_size: u64::from(BLOCK_SIZE),
                    medium: Some("GPU".into()),
                    extra_keys: Some(vec![None; blocks]),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                    ..BlockStored::default()
                })
            })
            .collect(),
        data_parallel_rank: Some(0),
        skipped_unknown: 0,
    };
    encode_batch(&batch, EventFormat::Map)
}

fn decode(c: &mut Criterion) {
    let (events, blocks) = (32, 4);
    let payload = busy_batch(events, blocks);
    let mut group = c.benchmark_group("decode");
    group.throughput(Throughput::Elements((events * blocks) as u64));
    group.bench_function("block_entries", |b| {
        b.iter(|| decode_batch(std::hint::black_box(&payload)).expect("decodes"))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    targets = keys, scan, decode
}
criterion_main!(benches);
