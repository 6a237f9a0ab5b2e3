//! A tokenizer's answer to vLLM's block keys: the token list read in one pass, keyed
//! block by block.

use serde::Deserialize;

use crate::config::Router;
use crate::keys::{BlockKey, DigestCache, KeyExtras};

/// vLLM's block keys (event form) of `tokens`, reusing digests from `cache` if given.
pub fn block_keys(
    router: &Router,
    extras: &KeyExtras,
    tokens: &[u32],
    cache: Option<&mut DigestCache>,
) -> Vec<BlockKey> {
    let mut chain = router.keys.chain(extras);
    match cache {
        Some(cache) => chain.extend_cached(tokens, cache),
        None => chain.extend(tokens),
    }
    chain.keys().collect()
}

/// Why a tokenizer answer is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// Not JSON with a `tokens` (or `token_ids`) array of u32.
    #[error("the tokenizer's answer has no token list")]
    NoTokens,
}

/// The token list of a `/tokenize` (`tokens`) or render (`token_ids`) answer.
///
/// Hot path: natively (release, 200 runs, three repeats) a 7,000-token answer took 109-121
/// us through `serde_json::Value`, 66-67 us through a typed `Vec<u32>`, and 28 us with this
/// one-pass scan. In wasm it keeps most of that speed (`cargo xtask bench core` times it
/// native and under wasmtime side by side: docs/benchmarks/core.md). Anything the scan does
/// not recognise falls back to the typed serde parse.
pub fn token_list(answer: &[u8]) -> Option<Vec<u32>> {
    scan_token_list(answer).or_else(|| {
        #[derive(Deserialize)]
        struct Answer {
            #[serde(default)]
            tokens: Option<Vec<u32>>,
            #[serde(default)]
            token_ids: Option<Vec<u32>>,
        }
        let answer: Answer = serde_json::from_slice(answer).ok()?;
        answer.tokens.or(answer.token_ids)
    })
}

/// Finds the top-level `"tokens"` or `"token_ids"` key and reads its array of plain
/// non-negative integers; `None` on anything unexpected.
fn scan_token_list(bytes: &[u8]) -> Option<Vec<u32>> {
    let mut depth = 0u32;
    let mut i = 0usize;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.checked_sub(1)?,
            b'"' => {
                let start = i + 1;
                let mut j = start;
                loop {
                    match bytes.get(j)? {
                        b'\\' => j += 2,
                        b'"' => break,
                        _ => j += 1,
                    }
                }
                let key = bytes.get(start..j)?;
                i = j;
                if depth == 1 && (key == b"tokens" || key == b"token_ids") {
                    let rest = bytes.get(j + 1..)?;
                    let colon = rest.iter().position(|c| !c.is_ascii_whitespace())?;
                    if rest.get(colon) != Some(&b':') {
                        continue;
                    }
                    return scan_int_array(rest.get(colon + 1..)?);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Reads an array of plain non-negative integers that fit in a `u32`.
///
/// Hot path: a number is read eight bytes at a time (up to seven digits, as every token id
/// of today's vocabularies) rather than byte by byte. Natively (release, 200 runs, three
/// repeats, AMD EPYC; a throwaway harness timing both versions in one process) a
/// 6,408-token answer took 65-72 us byte by byte and 39 us this way;
/// the scan was the largest single item of kvaffined's CPU in route callouts (18% of its
/// samples under `perf`), and the filter runs it under V8.
fn scan_int_array(bytes: &[u8]) -> Option<Vec<u32>> {
    let mut rest = bytes
        .trim_ascii_start()
        .strip_prefix(b"[")?
        .trim_ascii_start();
    let mut out = Vec::with_capacity(bytes.len() / 7);
    if rest.first() == Some(&b']') {
        return Some(out);
    }
    loop {
        let (value, after) = read_u32(rest)?;
        out.push(value);
        rest = after.trim_ascii_start();
        match rest.split_first()? {
            (b',', after) => rest = after.trim_ascii_start(),
            (b']', _) => return Some(out),
            _ => return None,
        }
    }
}

/// The number `bytes` start with (digits only; leading zeros allowed) and what follows it;
/// `None` without a digit or past `u32::MAX`.
fn read_u32(bytes: &[u8]) -> Option<(u32, &[u8])> {
    if let Some(head) = bytes.first_chunk::<8>() {
        let word = u64::from_le_bytes(*head);
        let len = leading_digits(word);
        if len == 0 {
            return None;
        }
        if len < 8 {
            return Some((digits_value(word, len), bytes.get(len..)?));
        }
    }
    let mut value: u32 = 0;
    let mut len = 0;
    for &b in bytes {
        let digit = b.wrapping_sub(b'0');
        if digit > 9 {
            break;
        }
        value = value.checked_mul(10)?.checked_add(u32::from(digit))?;
        len += 1;
    }
    if len == 0 {
        return None;
    }
    Some((value, bytes.get(len..)?))
}

/// Every byte of a `u64`.
const ONES: u64 = 0x0101_0101_0101_0101;

/// How many ASCII digits eight bytes (little-endian: the first byte lowest) start with. A
/// byte is a digit when its high nibble is 3 and adding 6 keeps it 3; a carry out of a
/// byte of 0xFA or more only reaches the bytes after it, past the run.
fn leading_digits(word: u64) -> usize {
    let high = (word & (0xF0 * ONES)) ^ (0x30 * ONES);
    let low = (word.wrapping_add(0x06 * ONES) & (0xF0 * ONES)) ^ (0x30 * ONES);
    ((high | low).trailing_zeros() / 8) as usize
}

/// The value of the first `len` (1 to 7) ASCII digits of eight bytes (little-endian): the
/// digits moved to the top, then pairs, fours and eights combined by multiplication.
fn digits_value(word: u64, len: usize) -> u32 {
    let digits = (word << (8 * (8 - len))) & (0x0F * ONES);
    let pairs = (digits.wrapping_mul(1 + (10 << 8)) >> 8) & 0x00FF_00FF_00FF_00FF;
    let fours = (pairs.wrapping_mul(1 + (100 << 16)) >> 16) & 0x0000_FFFF_0000_FFFF;
    // At most seven digits: the value fits in a u32.
    (fours.wrapping_mul(1 + (10_000 << 32)) >> 32) as u32
}

/// A prompt's block keys, and how many of its blocks vLLM can serve from its cache: it
/// always computes the last prompt token, so a prompt of exactly k full blocks, all
/// cached, is served k - 1 of them. The prediction a response reports is capped by it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptKeys {
    /// One key per full block, in order.
    pub keys: Vec<BlockKey>,
    /// The most blocks a cache hit can cover.
    pub servable_blocks: u64,
    /// The prompt's tokens.
    pub tokens: u64,
}

impl PromptKeys {
    /// The keys a lookup asks about and a booking holds: those of the servable blocks.
    /// A hit never covers the block holding the last prompt token, and on a hybrid model
    /// the sliding window vLLM keeps for the prompt ends where its servable blocks end, so
    /// a later prompt can be served only up to there.
    pub fn into_servable(mut self) -> Vec<BlockKey> {
        self.keys
            .truncate(usize::try_from(self.servable_blocks).unwrap_or(usize::MAX));
        self.keys
    }

    /// The keys of `tokens`, reusing digests from `cache` if given.
    pub fn of(
        router: &Router,
        extras: &KeyExtras,
        tokens: &[u32],
        cache: Option<&mut DigestCache>,
    ) -> Self {
        let block_size = router.keys.block_size().max(1);
        Self {
            keys: block_keys(router, extras, tokens, cache),
            servable_blocks: (tokens.len().saturating_sub(1) / block_size) as u64,
            tokens: tokens.len() as u64,
        }
    }
}

/// Prompt tokens per request-body byte, learned from the requests a VM tokenized: what a
/// request that is not tokenized (a new salt) tells kvaffined of the prefill it brings.
/// Load accounting only: keys always come from the tokenizer.
#[derive(Clone, Copy, Debug)]
pub struct TokensPerByte {
    rate: f64,
    learned: bool,
}

impl Default for TokensPerByte {
    /// A quarter of a token per byte until a request is tokenized (English prose in a
    /// BPE vocabulary runs about four bytes a token).
    fn default() -> Self {
        Self {
            rate: 0.25,
            learned: false,
        }
    }
}

impl TokensPerByte {
    /// Weight of each new request in the running rate.
    const WEIGHT: f64 = 0.1;

    /// A request of `body_bytes` bytes was `tokens` tokens.
    pub fn learn(&mut self, body_bytes: usize, tokens: u64) {
        if body_bytes == 0 {
            return;
        }
        let rate = tokens as f64 / body_bytes as f64;
        self.rate = if self.learned {
            self.rate + Self::WEIGHT * (rate - self.rate)
        } else {
            rate
        };
        self.learned = true;
    }

    /// The tokens a request of `body_bytes` bytes likely holds.
    pub fn estimate(&self, body_bytes: usize) -> u64 {
        (body_bytes as f64 * self.rate).round() as u64
    }
}

/// Keys of a `/tokenize` (or render) answer.
pub fn keys_from_tokenize(
    router: &Router,
    extras: &KeyExtras,
    answer: &[u8],
    cache: Option<&mut DigestCache>,
) -> Result<PromptKeys, TokenizeError> {
    let tokens = token_list(answer).ok_or(TokenizeError::NoTokens)?;
    Ok(PromptKeys::of(router, extras, &tokens, cache))
}

#[cfg(test)]
mod tests {
    use super::TokensPerByte;

    #[test]
    fn tokens_per_byte_start_at_a_quarter_then_follow_what_was_tokenized() {
        let mut rate = TokensPerByte::default();
        assert_eq!(rate.estimate(4_000), 1_000);
        rate.learn(0, 10);
        rate.learn(1_000, 500);
        assert_eq!(rate.estimate(4_000), 2_000);
        rate.learn(1_000, 1_500);
        assert_eq!(rate.estimate(1_000), 600);
    }

    use super::*;

    fn router() -> Router {
        Router::from_json(br#"{"block_size":4}"#).unwrap()
    }

    #[test]
    fn the_token_scan_agrees_with_serde_and_falls_back_on_the_unusual() {
        let cases: &[&[u8]] = &[
            br#"{"count":3,"max_model_len":10,"tokens":[1,22,333],"token_strs":null}"#,
            br#"{ "token_strs" : ["\"tokens\""], "tokens" : [ 4 , 5 ] }"#,
            br#"{"usage":{"tokens":[9]},"tokens":[7]}"#,
            br#"{"sampling_params":{"stop_token_ids":[2]},"token_ids":[8,9]}"#,
            br#"{"tokens":[]}"#,
            br#"{"tokens":[1e3]}"#,
            br#"{"tokens":[-1]}"#,
            br#"{"tokens":[4294967296]}"#,
            br#"{"tokens":"nope"}"#,
            br#"{"tokens":[1,2"#,
        ];
        let expected: [Option<Vec<u32>>; 10] = [
            Some(vec![1, 22, 333]),
            Some(vec![4, 5]),
            Some(vec![7]),
            Some(vec![8, 9]),
            Some(vec![]),
            None,
            None,
            None,
            None,
            None,
        ];
        for (case, want) in cases.iter().zip(expected) {
            assert_eq!(token_list(case), want, "{}", String::from_utf8_lossy(case));
        }
    }

    /// The eight-bytes-at-a-time number reader against serde, on arrays of every digit
    /// count (leading zeros, `u32::MAX` and past it), at every distance from the end of
    /// the buffer, and on bytes next to the digits (`/`, `:`) or that carry (0xFA-0xFF).
    #[test]
    fn the_token_scan_reads_numbers_of_every_length_as_serde_does() {
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let pieces: &[&[u8]] = &[
            b"0",
            b"7",
            b"42",
            b"151643",
            b"0000001",
            b"1234567",
            b"12345678",
            b"4294967295",
            b"4294967296",
            b"99999999999",
            b" ",
            b",",
            b"/",
            b":",
            b"\xfa",
            b"\xff",
            b"-1",
            b"1e3",
        ];
        for _ in 0..20_000 {
            let mut answer = b"{\"tokens\":[".to_vec();
            for i in 0..next() % 6 {
                if i > 0 {
                    answer.push(b',');
                }
                for _ in 0..1 + next() % 2 {
                    let piece = pieces.get((next() % pieces.len() as u64) as usize).unwrap();
                    answer.extend_from_slice(piece);
                }
            }
            answer.extend_from_slice(b"]}");
            #[derive(Deserialize)]
            struct Answer {
                tokens: Vec<u32>,
            }
            let parsed = serde_json::from_slice::<Answer>(&answer)
                .ok()
                .map(|a| a.tokens);
            let scanned = scan_token_list(&answer);
            // The scan may refuse what serde reads (it then falls back to serde), never
            // read it otherwise; it reads leading zeros, which serde refuses.
            if parsed.is_some() {
                assert_eq!(scanned, parsed, "{}", String::from_utf8_lossy(&answer));
            }
            assert_eq!(
                token_list(&answer).is_some(),
                scanned.is_some() || parsed.is_some()
            );
        }
    }

    #[test]
    fn tokenize_answers_become_keys() {
        let r = router();
        let keys = keys_from_tokenize(
            &r,
            &KeyExtras::default(),
            br#"{"count":9,"tokens":[1,2,3,4,5,6,7,8,9]}"#,
            None,
        )
        .unwrap();
        assert_eq!((keys.keys.len(), keys.servable_blocks), (2, 2));
        let render = keys_from_tokenize(
            &r,
            &KeyExtras::default(),
            br#"{"token_ids":[1,2,3,4]}"#,
            None,
        )
        .unwrap();
        assert_eq!(render.keys, keys.keys[..1]);
        // Exactly one full block: vLLM computes its last token, so nothing is servable.
        assert_eq!(render.servable_blocks, 0);
        assert_eq!(render.into_servable(), []);
        assert_eq!(keys.clone().into_servable(), keys.keys);
        assert!(
            keys_from_tokenize(&r, &KeyExtras::default(), br#"{"tokens":[-1]}"#, None).is_err()
        );
    }
}
