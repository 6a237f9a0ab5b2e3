//! Any bytes: the decoder returns (never panics), and whatever it accepts re-encodes to a
//! payload that decodes to the same batch.
#![no_main]

use kvaffine_core::events::{EventFormat, decode_batch, encode_batch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    if batch.ts.is_nan() {
        return;
    }
    let again = decode_batch(&encode_batch(&batch, EventFormat::Map));
    assert_eq!(again.as_ref().map(|b| &b.events), Ok(&batch.events));
    let positional = decode_batch(&encode_batch(&batch, EventFormat::Positional));
    assert_eq!(positional.map(|b| b.events.len()), Ok(batch.events.len()));
});
