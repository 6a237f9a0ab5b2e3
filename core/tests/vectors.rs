//! Golden vectors produced by vLLM's own code (`../shared/vectors`, read in place, never
//! copied). A missing file fails these tests: without the vectors nothing here is proven.

// Test code: a failed expectation is a panic.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::PathBuf;

use kvaffine_core::events::{
    self, BlockStored, EngineHash, EventBatch, EventFormat, ExtraKey, KvEvent, ReplayMessage,
};
use kvaffine_core::{CacheSalt, HashAlgo, KeyConfig, KeyExtras, LoraAdapter, VllmCompat};
use serde_json::{Value, json};

fn vectors(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/vectors")
        .join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("golden vectors {} are required: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    hex::decode(s).unwrap()
}

fn compat_of(version: &str) -> VllmCompat {
    match version {
        "0.33.0" => VllmCompat::V0_31,
        "0.30.0" | "0.28.0" => VllmCompat::V0_30,
        other => panic!("no compatibility level for vLLM {other}"),
    }
}

#[test]
fn every_cbor_block_hash_case_matches_vllm() {
    let data = vectors("block_hashes.json");
    let mut checked_cases = 0;
    let mut checked_blocks = 0;
    let mut expected_cases = 0;
    for version in data["versions"].as_array().unwrap() {
        let compat = compat_of(version["vllm_version"].as_str().unwrap());
        for case in version["cases"].as_array().unwrap() {
            let algo: HashAlgo = match case["algo"].as_str().unwrap().parse() {
                Ok(algo) => algo,
                Err(_) => continue, // pickle algorithms: not reproducible by design
            };
            if case.get("skipped").is_some() {
                continue;
            }
            expected_cases += 1;
            let id = case["id"].as_str().unwrap();
            let seed = case["pythonhashseed"].as_str();
            let block_size = case["block_size"].as_u64().unwrap() as usize;
            let config = KeyConfig::new(algo, block_size, seed, compat).unwrap();
            assert_eq!(
                config.none_hash().to_hex(),
                case["none_hash_hex"].as_str().unwrap(),
                "{id}: NONE_HASH"
            );
            let extras = KeyExtras {
                cache_salt: case["cache_salt"]
                    .as_str()
                    .map(|s| CacheSalt::parse(s).unwrap()),
                lora: case["lora"].as_object().map(|l| LoraAdapter {
                    name: l["lora_name"].as_str().unwrap().to_owned(),
                    path: l["lora_path"].as_str().unwrap().to_owned(),
                }),
            };
            let tokens: Vec<u32> = data["sequences"][case["sequence"].as_str().unwrap()]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let mut chain = config.chain(&extras);
            chain.extend(&tokens);
            let blocks = case["blocks"].as_array().unwrap();
            assert_eq!(chain.digests().len(), blocks.len(), "{id}: block count");
            assert_eq!(
                chain.pending_tokens() as u64,
                case["trailing_tokens_not_hashed"].as_u64().unwrap(),
                "{id}: tail"
            );
            for (block, (digest, key)) in
                blocks.iter().zip(chain.digests().iter().zip(chain.keys()))
            {
                let index = &block["index"];
                assert_eq!(
                    digest.to_hex(),
                    block["hash_hex"].as_str().unwrap(),
                    "{id} block {index}"
                );
                assert_eq!(
                    key.0,
                    block["event_block_hash_int"].as_u64().unwrap(),
                    "{id} block {index}"
                );
                checked_blocks += 1;
            }
            // Token-by-token extension reaches the same keys.
            let mut stepwise = config.chain(&extras);
            for token in &tokens {
                stepwise.extend(std::slice::from_ref(token));
            }
            assert_eq!(stepwise.digests(), chain.digests(), "{id}: incremental");
            checked_cases += 1;
        }
    }
    assert_eq!(checked_cases, expected_cases);
    assert_eq!(
        checked_cases, 160,
        "every sha256_cbor and xxhash_cbor case of the file"
    );
    assert!(checked_blocks > 500, "only {checked_blocks} blocks checked");
}

fn format_of(version: &str) -> EventFormat {
    match version {
        "0.33.0" => EventFormat::Map,
        "0.23.0" => EventFormat::Positional,
        other => panic!("no event format for vLLM {other}"),
    }
}

fn hash_json(hash: &EngineHash) -> Value {
    match hash {
        EngineHash::Int(v) => json!(v),
        EngineHash::Digest(d) => json!({ "bytes_hex": d.to_hex() }),
    }
}

fn opt<T: serde::Serialize>(value: &Option<T>) -> Value {
    json!(value)
}

fn extra_keys_json(stored: &BlockStored) -> Value {
    match &stored.extra_keys {
        None => Value::Null,
        Some(blocks) => Value::Array(
            blocks
                .iter()
                .map(|block| match block {
                    None => Value::Null,
                    Some(items) => Value::Array(
                        items
                            .iter()
                            .map(|item| match item {
                                ExtraKey::Text(s) => json!(s),
                                ExtraKey::Other(raw) => panic!("no JSON form for {raw:?}"),
                            })
                            .collect(),
                    ),
                })
                .collect(),
        ),
    }
}

/// The untyped decode vLLM's vectors record, rebuilt from this crate's typed decode.
fn untyped(batch: &EventBatch, format: EventFormat) -> Value {
    let events = batch.events.iter().map(|event| match (event, format) {
        (KvEvent::BlockStored(e), EventFormat::Map) => {
            let mut m = json!({
                "type": "BlockStored",
                "block_hashes": e.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
                "parent_block_hash": e.parent_block_hash.as_ref().map(hash_json),
                "token_ids": e.token_ids,
                "block_size": e.block_size,
                "lora_id": e.lora_id,
                "medium": e.medium,
                "lora_name": e.lora_name,
            });
            let obj = m.as_object_mut().unwrap();
            if e.extra_keys.is_some() {
                obj.insert("extra_keys".into(), extra_keys_json(e));
            }
            if let Some(v) = e.group_idx {
                obj.insert("group_idx".into(), json!(v));
            }
            if let Some(v) = &e.kv_cache_spec_kind {
                obj.insert("kv_cache_spec_kind".into(), json!(v));
            }
            if let Some(v) = e.kv_cache_spec_sliding_window {
                obj.insert("kv_cache_spec_sliding_window".into(), json!(v));
            }
            assert!(e.locality.is_none() && e.ownership.is_none() && e.session_id.is_none());
            m
        }
        (KvEvent::BlockStored(e), EventFormat::Positional) => json!([
            "BlockStored",
            e.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
            e.parent_block_hash.as_ref().map(hash_json),
            e.token_ids,
            e.block_size,
            e.lora_id,
            e.medium,
            e.lora_name,
            extra_keys_json(e),
            e.group_idx,
            e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window,
        ]),
        (KvEvent::BlockRemoved(e), EventFormat::Map) => {
            let mut m = json!({
                "type": "BlockRemoved",
                "block_hashes": e.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
                "medium": e.medium,
            });
            if let Some(v) = e.group_idx {
                m.as_object_mut()
                    .unwrap()
                    .insert("group_idx".into(), json!(v));
            }
            m
        }
        (KvEvent::BlockRemoved(e), EventFormat::Positional) => json!([
            "BlockRemoved",
            e.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
            e.medium,
            opt(&e.group_idx),
        ]),
        (KvEvent::AllBlocksCleared, EventFormat::Map) => json!({ "type": "AllBlocksCleared" }),
        (KvEvent::AllBlocksCleared, EventFormat::Positional) => json!(["AllBlocksCleared"]),
    });
    json!([
        batch.ts,
        events.collect::<Vec<_>>(),
        batch.data_parallel_rank
    ])
}

#[test]
fn every_event_payload_decodes_to_vllms_form_and_reencodes_byte_for_byte() {
    let data = vectors("kv_events.json");
    let mut payloads = 0;
    for version in data["versions"].as_array().unwrap() {
        let name = version["vllm_version"].as_str().unwrap();
        let format = format_of(name);
        for (kind, payload) in version["payloads"].as_object().unwrap() {
            let bytes = unhex(payload["msgpack_hex"].as_str().unwrap());
            let batch = events::decode_batch(&bytes).unwrap();
            assert_eq!(untyped(&batch, format), payload["decoded"], "{name} {kind}");
            assert_eq!(batch.skipped_unknown, 0);
            assert_eq!(
                hex::encode(events::encode_batch(&batch, format)),
                payload["msgpack_hex"].as_str().unwrap(),
                "{name} {kind}: re-encoded bytes"
            );
            if let Some(events_hex) = payload.get("events_hex") {
                let events_hex = events_hex.as_array().unwrap();
                assert_eq!(events_hex.len(), batch.events.len());
                for (event, want) in batch.events.iter().zip(events_hex) {
                    let single = EventBatch {
                        events: vec![event.clone()],
                        ..batch.clone()
                    };
                    let encoded = events::encode_batch(&single, format);
                    // [ts f64, [event], rank]: 1 + 9 + 1 header bytes, 1 trailing byte.
                    let event_bytes = &encoded[11..encoded.len() - 1];
                    assert_eq!(
                        hex::encode(event_bytes),
                        want.as_str().unwrap(),
                        "{name} {kind}"
                    );
                }
            }
            payloads += 1;
        }
    }
    assert_eq!(payloads, 6);
}

#[test]
fn every_captured_zmq_frame_parses_and_decodes() {
    let data = vectors("kv_events.json");
    for version in data["versions"].as_array().unwrap() {
        let name = version["vllm_version"].as_str().unwrap();
        let expected = &version["payloads"]["int_hashes_default"]["decoded"];
        let format = format_of(name);
        let capture = &version["zmq_capture"];
        let frames = |message: &Value| -> Vec<Vec<u8>> {
            message
                .as_array()
                .unwrap()
                .iter()
                .map(|f| unhex(f.as_str().unwrap()))
                .collect()
        };
        let topic = capture["topic"].as_str().unwrap().as_bytes();
        for (seq, message) in capture["live"].as_array().unwrap().iter().enumerate() {
            let frames = frames(message);
            let live = events::parse_live(&frames).unwrap();
            assert_eq!((live.topic, live.seq), (topic, seq as u64), "{name}");
            let batch = events::decode_batch(live.payload).unwrap();
            assert_eq!(&untyped(&batch, format), expected, "{name} live {seq}");
        }
        let replay = capture["replay_dealer"].as_array().unwrap();
        let first = frames(&replay[0]);
        match events::parse_replay(&first).unwrap() {
            ReplayMessage::Batch {
                topic: got_topic,
                seq,
                payload,
            } => {
                assert_eq!(seq, 1, "{name}: replay from start_seq=1");
                let want_topic = (format == EventFormat::Map).then_some(topic);
                assert_eq!(got_topic, want_topic, "{name}: topic frame since 0.26");
                let batch = events::decode_batch(payload).unwrap();
                assert_eq!(&untyped(&batch, format), expected, "{name} replay");
            }
            ReplayMessage::End => panic!("{name}: replay ended before its batch"),
        }
        let end = frames(replay.last().unwrap());
        assert_eq!(events::parse_replay(&end).unwrap(), ReplayMessage::End);
        assert_eq!(
            hex::encode(events::END_SEQ.to_be_bytes()),
            version["END_SEQ_hex"].as_str().unwrap()
        );
        // A REQ client gets only the first reply, without the delimiter; its payload is
        // still an ordinary batch.
        for message in capture["replay_req"].as_array().unwrap() {
            let frames = frames(message);
            let batch = events::decode_batch(frames.last().unwrap()).unwrap();
            assert_eq!(&untyped(&batch, format), expected, "{name} REQ replay");
        }
    }
}

#[test]
fn emulated_publisher_frames_parse_as_vllm_033_frames() {
    let data = vectors("kv_events.json");
    let version = &data["versions"][0];
    assert_eq!(version["vllm_version"], "0.33.0");
    let capture = &version["zmq_capture"];
    let payload = unhex(
        version["payloads"]["int_hashes_default"]["msgpack_hex"]
            .as_str()
            .unwrap(),
    );
    let live = events::live_frames(b"kv-events", 1, &payload);
    let captured: Vec<String> = capture["live"][1]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(live.iter().map(hex::encode).collect::<Vec<_>>(), captured);
    // What a ROUTER sends reaches the DEALER without the identity frame.
    let replay = events::replay_frames(b"id", b"kv-events", 1, &payload);
    let want: Vec<String> = capture["replay_dealer"][0]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        replay[1..].iter().map(hex::encode).collect::<Vec<_>>(),
        want
    );
    let end = events::replay_end_frames(b"id");
    let want_end: Vec<String> = capture["replay_dealer"][1]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        end[1..].iter().map(hex::encode).collect::<Vec<_>>(),
        want_end
    );
}

#[test]
fn data_parallel_endpoints_shift_as_vllm_shifts_them() {
    let data = vectors("kv_events.json");
    for version in data["versions"].as_array().unwrap() {
        for (input, want) in version["offset_endpoint_port"].as_object().unwrap() {
            let (endpoint, rank) = input.rsplit_once(" rank=").unwrap();
            let got = events::offset_endpoint_for_rank(endpoint, rank.parse().unwrap()).unwrap();
            assert_eq!(got, want.as_str().unwrap(), "{input}");
        }
    }
    assert_eq!(
        events::offset_endpoint_for_rank("tcp://*:0", 2).unwrap(),
        "tcp://*:0"
    );
    assert!(events::offset_endpoint_for_rank("ipc:///tmp/x", 1).is_err());
}
