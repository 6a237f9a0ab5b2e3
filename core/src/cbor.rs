//! The few pieces of canonical CBOR (RFC 8949 §4.2.1) that vLLM's block-hash preimage uses.
//!
//! vLLM hashes `cbor2.dumps((parent, tokens, extra_keys), canonical=True)`. Only unsigned
//! integers, byte strings, text strings, arrays and `null` ever occur, always with the
//! shortest head, so a generic CBOR library would add nothing but per-call allocation.

/// Major type of an unsigned integer.
const MAJOR_UINT: u8 = 0;
/// Major type of a byte string.
const MAJOR_BYTES: u8 = 2;
/// Major type of a UTF-8 text string.
const MAJOR_TEXT: u8 = 3;
/// Major type of an array.
const MAJOR_ARRAY: u8 = 4;
/// The simple value `null`, which vLLM writes for "no extra keys".
pub(crate) const NULL: u8 = 0xf6;

/// Appends a head with the shortest encoding of `value`, as canonical CBOR requires.
#[inline]
pub(crate) fn write_head(out: &mut Vec<u8>, major: u8, value: u64) {
    let m = major << 5;
    if value < 24 {
        out.push(m | value as u8);
    } else if value <= u64::from(u8::MAX) {
        out.extend_from_slice(&[m | 24, value as u8]);
    } else if value <= u64::from(u16::MAX) {
        let b = (value as u16).to_be_bytes();
        out.extend_from_slice(&[m | 25, b[0], b[1]]);
    } else if value <= u64::from(u32::MAX) {
        let b = (value as u32).to_be_bytes();
        out.extend_from_slice(&[m | 26, b[0], b[1], b[2], b[3]]);
    } else {
        out.push(m | 27);
        out.extend_from_slice(&value.to_be_bytes());
    }
}

/// Appends an unsigned integer (a token id).
#[inline]
pub(crate) fn write_uint(out: &mut Vec<u8>, value: u64) {
    write_head(out, MAJOR_UINT, value);
}

/// Appends a byte string (a parent digest).
pub(crate) fn write_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    write_head(out, MAJOR_BYTES, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Appends a text string (a seed, LoRA name or path, cache salt, or tag).
pub(crate) fn write_text(out: &mut Vec<u8>, text: &str) {
    write_head(out, MAJOR_TEXT, text.len() as u64);
    out.extend_from_slice(text.as_bytes());
}

/// Appends the head of an array of `len` items; the caller appends the items.
pub(crate) fn write_array_head(out: &mut Vec<u8>, len: usize) {
    write_head(out, MAJOR_ARRAY, len as u64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_use_the_shortest_form_at_every_width_boundary() {
        let cases: &[(u64, &[u8])] = &[
            (0, &[0x00]),
            (23, &[0x17]),
            (24, &[0x18, 24]),
            (255, &[0x18, 0xff]),
            (256, &[0x19, 0x01, 0x00]),
            (65535, &[0x19, 0xff, 0xff]),
            (65536, &[0x1a, 0x00, 0x01, 0x00, 0x00]),
            (u64::from(u32::MAX), &[0x1a, 0xff, 0xff, 0xff, 0xff]),
            (1 << 32, &[0x1b, 0, 0, 0, 1, 0, 0, 0, 0]),
        ];
        for (value, want) in cases {
            let mut out = Vec::new();
            write_uint(&mut out, *value);
            assert_eq!(out, *want, "value {value}");
        }
    }

    #[test]
    fn strings_and_arrays_carry_their_major_type() {
        let mut out = Vec::new();
        write_array_head(&mut out, 2);
        write_text(&mut out, "cache_salt");
        write_bytes(&mut out, &[1, 2]);
        assert_eq!(
            out,
            [&[0x82, 0x6a][..], b"cache_salt", &[0x42, 1, 2]].concat()
        );
    }
}
