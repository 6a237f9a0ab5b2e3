//! The benchmark kernel: each workload compiled natively and to `wasm32-wasip1`, so the
//! native and wasm figures in `docs/benchmarks/core.md` time identical work.
//!
//! The module keeps its own token buffer (filled by a fixed generator) and the tokenizer
//! answer that lists it, so the host only calls exported functions with integers and never
//! touches guest memory.
// `no_mangle` exports are the module's whole interface; nothing else here is unsafe.
#![allow(unsafe_code)]

use std::cell::RefCell;

use kvaffine_core::{HashAlgo, KeyConfig, KeyExtras, VllmCompat};

/// Vocabulary size of Qwen-family models: ids spread over 1-, 3- and 5-byte CBOR forms
/// as real prompts do.
const VOCAB: u32 = 151_936;

thread_local! {
    static TOKENS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static ANSWER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// `count` pseudo-random token ids from a fixed xorshift sequence.
pub fn tokens(count: usize) -> Vec<u32> {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % u64::from(VOCAB)) as u32
        })
        .collect()
}

/// Keys `tokens` with sha256_cbor at `block_size`, `reps` times; returns a checksum of the
/// keys so the work cannot be optimised away.
pub fn key_tokens(tokens: &[u32], block_size: usize, reps: u32) -> u64 {
    let Ok(config) = KeyConfig::new(HashAlgo::Sha256Cbor, block_size, None, VllmCompat::V0_31)
    else {
        return 0;
    };
    let mut checksum = 0u64;
    for _ in 0..reps {
        let mut chain = config.chain(&KeyExtras::default());
        chain.extend(tokens);
        checksum ^= chain.keys().fold(0, |acc, k| acc ^ k.0);
    }
    checksum
}

/// SHA-256 alone over buffers the size of the preimages [`key_tokens`] hashes (same
/// count, same lengths), `reps` times: the share of keying that is the hash itself.
pub fn sha256_only(tokens: &[u32], block_size: usize, reps: u32) -> u64 {
    use sha2::{Digest, Sha256};
    let cbor_width = |t: u32| match t {
        0..=23 => 1,
        24..=255 => 2,
        256..=65535 => 3,
        _ => 5,
    };
    // Array(3) head, 32-byte parent with its 2-byte head, token-array head, null extras.
    let overhead = 1 + 2 + 32 + 2 + 1;
    let buffers: Vec<Vec<u8>> = tokens
        .chunks_exact(block_size)
        .map(|block| vec![0x5a; overhead + block.iter().map(|t| cbor_width(*t)).sum::<usize>()])
        .collect();
    let mut checksum = 0u64;
    for _ in 0..reps {
        for buffer in &buffers {
            let digest = Sha256::digest(buffer);
            checksum ^= u64::from(digest[31]);
        }
    }
    checksum
}

/// vLLM's `/tokenize` answer for `tokens`, written as its server writes JSON (no spaces).
pub fn tokenize_answer(tokens: &[u32]) -> Vec<u8> {
    let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
    format!(
        r#"{{"count":{},"max_model_len":131072,"tokens":[{}],"token_strs":null}}"#,
        tokens.len(),
        list.join(",")
    )
    .into_bytes()
}

/// An order-sensitive checksum of a token list, so the work of reading it cannot be
/// optimised away and two readers can be compared.
pub fn checksum(list: &[u32]) -> u64 {
    list.iter().fold(list.len() as u64, |acc, &t| {
        acc.wrapping_mul(31).wrapping_add(u64::from(t))
    })
}

/// Reads the token list out of `answer`, as the filter reads a tokenizer's answer, `reps`
/// times; returns the sum of [`checksum`]s of what was read (0 for an answer it cannot
/// read).
pub fn scan_answer(answer: &[u8], reps: u32) -> u64 {
    (0..reps).fold(0u64, |sum, _| {
        let read = kvaffine_core::tokens::token_list(answer).unwrap_or_default();
        sum.wrapping_add(checksum(&read))
    })
}

/// Fills the module's token buffer with `count` tokens, and its answer with their list.
#[unsafe(no_mangle)]
pub extern "C" fn kernel_fill_tokens(count: u32) {
    let filled = tokens(count as usize);
    ANSWER.with(|a| *a.borrow_mut() = tokenize_answer(&filled));
    TOKENS.with(|t| *t.borrow_mut() = filled);
}

/// [`key_tokens`] over the module's token buffer.
#[unsafe(no_mangle)]
pub extern "C" fn kernel_key_tokens(block_size: u32, reps: u32) -> u64 {
    TOKENS.with(|t| key_tokens(&t.borrow(), block_size as usize, reps))
}

/// [`sha256_only`] over the module's token buffer.
#[unsafe(no_mangle)]
pub extern "C" fn kernel_sha256_only(block_size: u32, reps: u32) -> u64 {
    TOKENS.with(|t| sha256_only(&t.borrow(), block_size as usize, reps))
}

/// [`scan_answer`] over the module's answer.
#[unsafe(no_mangle)]
pub extern "C" fn kernel_scan_answer(reps: u32) -> u64 {
    ANSWER.with(|a| scan_answer(&a.borrow(), reps))
}
