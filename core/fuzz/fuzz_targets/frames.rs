//! Any multipart message: live and replay parsing return (never panic), and what parses
//! as a live message rebuilds to the same frames.
#![no_main]

use kvaffine_core::events::{live_frames, parse_live, parse_replay, start_seq_of_replay_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|frames: Vec<Vec<u8>>| {
    let _ = parse_replay(&frames);
    let _ = start_seq_of_replay_request(&frames);
    if let Ok(live) = parse_live(&frames) {
        let rebuilt = live_frames(live.topic, live.seq, live.payload);
        assert_eq!(rebuilt.as_slice(), frames.as_slice());
    }
});
