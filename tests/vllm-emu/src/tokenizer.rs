//! A deterministic tokenizer with a Qwen-sized vocabulary and Qwen's special tokens.
//!
//! It is not a BPE: every pre-token piece maps to one id by hash. What it shares with a
//! real tokenizer is what routing depends on: the same text always gives the same ids,
//! ids spread over the whole vocabulary (so every CBOR integer width occurs in keys), and
//! pieces never span a newline or a special token, so tokenizing a prompt and then its
//! continuation gives the tokens of the whole.

/// Vocabulary size (Qwen2/3).
pub const VOCAB: u32 = 151_936;

/// Special tokens and their ids (Qwen's).
pub const SPECIALS: [(&str, u32); 7] = [
    ("<|endoftext|>", 151_643),
    ("<|im_start|>", 151_644),
    ("<|im_end|>", 151_645),
    ("<tool_call>", 151_657),
    ("</tool_call>", 151_658),
    ("<think>", 151_667),
    ("</think>", 151_668),
];

/// Ordinary pieces map into `0..FIRST_SPECIAL`.
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

/// The pieces of `text` and their ids.
pub fn tokenize(text: &str) -> Vec<(u32, &str)> {
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

/// The ids of `text`.
pub fn token_ids(text: &str) -> Vec<u32> {
    tokenize(text).into_iter().map(|(id, _)| id).collect()
}

fn piece_id(piece: &str) -> u32 {
    (xxhash_rust::xxh3::xxh3_64(piece.as_bytes()) % u64::from(FIRST_SPECIAL)) as u32
}

/// The text of one id, for ids this tokenizer produces from words (generation).
pub fn special_text(id: u32) -> Option<&'static str> {
    SPECIALS.iter().find(|(_, i)| *i == id).map(|(s, _)| *s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_text_exactly() {
        let text = "<|im_start|>user\nHello,  world 12345!\n\n<think>\nok</think>é ü";
        let pieces: String = tokenize(text).iter().map(|(_, p)| *p).collect();
        assert_eq!(pieces, text);
        let ids = token_ids(text);
        assert_eq!(ids[0], 151_644);
        assert!(ids.iter().all(|&id| id < VOCAB));
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
        let pieces: Vec<&str> = tokenize("a bc 1234567").iter().map(|(_, p)| *p).collect();
        assert_eq!(pieces, ["a", " bc", " 123", "456", "7"]);
    }
}
