//! The decoder faces whatever arrives on a replica's socket: it must never panic, and what
//! it accepts must survive a re-encode unchanged. Bounded runs here; the open-ended fuzz
//! target is `core/fuzz` (see docs/fuzzing.md).

// Test code: a failed expectation is a panic.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::PathBuf;

use kvaffine_core::Digest;
use kvaffine_core::events::{
    self, BlockRemoved, BlockStored, EngineHash, EventBatch, EventFormat, ExtraKey, KvEvent,
    RawValue,
};
use proptest::prelude::*;

fn golden_payloads() -> Vec<Vec<u8>> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/vectors/kv_events.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("golden vectors {} are required: {e}", path.display()));
    let data: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for version in data["versions"].as_array().unwrap() {
        for payload in version["payloads"].as_object().unwrap().values() {
            out.push(hex::decode(payload["msgpack_hex"].as_str().unwrap()).unwrap());
        }
    }
    out
}

/// Whatever decodes must encode to something that decodes to the same batch.
fn assert_stable(bytes: &[u8]) {
    if let Ok(batch) = events::decode_batch(bytes) {
        if batch.ts.is_nan() {
            return;
        }
        for format in [EventFormat::Map, EventFormat::Positional] {
            let again = events::decode_batch(&events::encode_batch(&batch, format)).unwrap();
            if format == EventFormat::Map {
                assert_eq!(again.events, batch.events);
            }
            assert_eq!(again.events.len(), batch.events.len());
            assert_eq!(again.data_parallel_rank, batch.data_parallel_rank);
        }
    }
}

fn hash() -> impl Strategy<Value = EngineHash> {
    prop_oneof![
        any::<u64>().prop_map(EngineHash::Int),
        prop::collection::vec(any::<u8>(), 1..=32)
            .prop_map(|b| EngineHash::Digest(Digest::from_slice(&b).unwrap())),
    ]
}

fn raw() -> impl Strategy<Value = RawValue> {
    prop_oneof![
        Just(RawValue(vec![0x2a])),
        Just(RawValue(vec![0xa3, b'a', b'b', b'c'])),
        Just(RawValue(vec![0x92, 0x01, 0xc3])),
    ]
}

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_é-]{0,40}"
}

fn stored() -> impl Strategy<Value = BlockStored> {
    (
        (
            prop::collection::vec(hash(), 0..4),
            prop::option::of(hash()),
            prop::collection::vec(any::<u32>(), 0..70),
            any::<u64>(),
            prop::option::of(any::<i64>()),
            prop::option::of(text()),
            prop::option::of(text()),
        ),
        (
            prop::option::of(prop::collection::vec(
                prop::option::of(prop::collection::vec(
                    prop_oneof![
                        text().prop_map(ExtraKey::Text),
                        // A multimodal [identifier, offset] pair: anything but a string.
                        Just(ExtraKey::Other(RawValue(vec![0x92, 0xa1, b'm', 0x05]))),
                    ],
                    0..3,
                )),
                0..4,
            )),
            prop::option::of(any::<i64>()),
            prop::option::of(text()),
            prop::option::of(any::<i64>()),
            prop::option::of(raw()),
            prop::option::of(raw()),
            prop::option::of(raw()),
            prop::option::of(raw()),
        ),
    )
        .prop_map(|(a, b)| BlockStored {
            block_hashes: a.0,
            parent_block_hash: a.1,
            token_ids: a.2,
            block_size: a.3,
            lora_id: a.4,
            medium: a.5,
            lora_name: a.6,
            extra_keys: b.0,
            group_idx: b.1,
            kv_cache_spec_kind: b.2,
            kv_cache_spec_sliding_window: b.3,
            locality: b.4,
            ownership: b.5,
            session_id: b.6,
            lookahead_token_ids: b.7,
        })
}

fn event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        stored().prop_map(KvEvent::BlockStored),
        (
            prop::collection::vec(hash(), 0..4),
            prop::option::of(text()),
            prop::option::of(any::<i64>()),
            prop::option::of(raw()),
            prop::option::of(raw()),
        )
            .prop_map(|(block_hashes, medium, group_idx, locality, ownership)| {
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                    locality,
                    ownership,
                })
            }),
        Just(KvEvent::AllBlocksCleared),
    ]
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<f64>().prop_filter("NaN never equals itself", |t| !t.is_nan()),
        prop::collection::vec(event(), 0..20),
        prop::option::of(any::<i64>()),
    )
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch {
            ts,
            events,
            data_parallel_rank,
            skipped_unknown: 0,
        })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn any_batch_round_trips_through_the_map_layout(batch in batch()) {
        let bytes = events::encode_batch(&batch, EventFormat::Map);
        prop_assert_eq!(events::decode_batch(&bytes).unwrap(), batch);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        assert_stable(&bytes);
    }

    #[test]
    fn mutated_golden_payloads_never_panic(
        which in 0usize..6,
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = golden_payloads().swap_remove(which);
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        assert_stable(&bytes);
    }
}

#[test]
fn unknown_event_types_and_fields_are_skipped_not_fatal() {
    let mut bytes = vec![0x93, 0xcb];
    bytes.extend_from_slice(&1.5f64.to_be_bytes());
    bytes.push(0x93);
    // A future event type with fields of its own.
    bytes.extend_from_slice(&[0x82, 0xa4]);
    bytes.extend_from_slice(b"type");
    bytes.push(0xa9);
    bytes.extend_from_slice(b"BlockMove");
    bytes.push(0xa9);
    bytes.extend_from_slice(b"token_ids");
    bytes.push(0xa1);
    bytes.push(b'x');
    // A known event with an unknown key.
    bytes.extend_from_slice(&[0x83, 0xa4]);
    bytes.extend_from_slice(b"type");
    bytes.push(0xac);
    bytes.extend_from_slice(b"BlockRemoved");
    bytes.push(0xac);
    bytes.extend_from_slice(b"block_hashes");
    bytes.extend_from_slice(&[0x91, 0xd3]);
    bytes.extend_from_slice(&(-5i64).to_be_bytes());
    bytes.push(0xa3);
    bytes.extend_from_slice(b"new");
    bytes.extend_from_slice(&[0x91, 0x01]);
    // A positional event with a trailing field from the future.
    bytes.extend_from_slice(&[0x92, 0xb0]);
    bytes.extend_from_slice(b"AllBlocksCleared");
    bytes.push(0x07);
    bytes.push(0x01); // dp rank
    let batch = events::decode_batch(&bytes).unwrap();
    assert_eq!(batch.skipped_unknown, 1);
    assert_eq!(batch.data_parallel_rank, Some(1));
    assert_eq!(
        batch.events,
        vec![
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash::Int((-5i64) as u64)],
                ..BlockRemoved::default()
            }),
            KvEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn hostile_lengths_and_nesting_are_refused_without_allocating_or_recursing() {
    // A batch claiming 2^32-1 events in a 16-byte payload.
    let mut bytes = vec![0x93, 0xcb];
    bytes.extend_from_slice(&0f64.to_be_bytes());
    bytes.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert!(events::decode_batch(&bytes).is_err());
    // An unknown key whose value nests a million arrays deep.
    let mut deep = vec![0x93, 0xcb];
    deep.extend_from_slice(&0f64.to_be_bytes());
    deep.extend_from_slice(&[0x91, 0x82, 0xa4]);
    deep.extend_from_slice(b"type");
    deep.push(0xb0);
    deep.extend_from_slice(b"AllBlocksCleared");
    deep.extend_from_slice(&[0xa1, b'z']);
    deep.extend(std::iter::repeat_n(0x91, 1_000_000));
    deep.push(0xc0);
    deep.push(0xc0);
    let batch = events::decode_batch(&deep).unwrap();
    assert_eq!(batch.events, vec![KvEvent::AllBlocksCleared]);
}

#[test]
fn a_batch_with_two_elements_is_a_vllm_090_batch() {
    let mut bytes = vec![0x92, 0xcb];
    bytes.extend_from_slice(&2.0f64.to_be_bytes());
    bytes.push(0x90);
    let batch = events::decode_batch(&bytes).unwrap();
    assert_eq!((batch.ts, batch.data_parallel_rank), (2.0, None));
    bytes.push(0x00);
    assert_eq!(
        events::decode_batch(&bytes),
        Err(events::DecodeError::TrailingBytes(1))
    );
}
