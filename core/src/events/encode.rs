//! An encoder that writes batches exactly as vLLM's msgspec publisher does, so the
//! emulator's events are indistinguishable from a real replica's.
//!
//! msgspec picks the shortest msgpack form for every value except one: a struct map gets a
//! header sized for the struct's maximum field count, so `BlockStored` (16 possible keys)
//! always starts `de 00 nn` while `BlockRemoved` and `AllBlocksCleared` use a fixmap.

use super::{BlockRemoved, BlockStored, EngineHash, EventBatch, ExtraKey, KvEvent, RawValue};

/// Which vLLM generation's event layout to write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EventFormat {
    /// vLLM >= 0.24: events are maps keyed by field name, defaults omitted.
    #[default]
    Map,
    /// vLLM <= 0.23: events are arrays, every field of 0.23 present (fields added later
    /// do not exist in that layout and are not written).
    Positional,
}

/// Encodes a batch as the replica's publisher would put it in the payload frame.
pub fn encode_batch(batch: &EventBatch, format: EventFormat) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(estimate(batch)));
    w.array(3);
    w.f64(batch.ts);
    w.array(batch.events.len());
    for event in &batch.events {
        match (event, format) {
            (KvEvent::BlockStored(e), EventFormat::Map) => w.stored_map(e),
            (KvEvent::BlockStored(e), EventFormat::Positional) => w.stored_positional(e),
            (KvEvent::BlockRemoved(e), EventFormat::Map) => w.removed_map(e),
            (KvEvent::BlockRemoved(e), EventFormat::Positional) => w.removed_positional(e),
            (KvEvent::AllBlocksCleared, EventFormat::Map) => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
            (KvEvent::AllBlocksCleared, EventFormat::Positional) => {
                w.array(1);
                w.str("AllBlocksCleared");
            }
        }
    }
    w.opt_i64(batch.data_parallel_rank);
    w.0
}

/// A capacity guess that avoids regrowth for typical batches.
fn estimate(batch: &EventBatch) -> usize {
    let per_event: usize = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => 256 + 9 * s.block_hashes.len() + 5 * s.token_ids.len(),
            KvEvent::BlockRemoved(r) => 64 + 9 * r.block_hashes.len(),
            KvEvent::AllBlocksCleared => 24,
        })
        .sum();
    16 + per_event
}

struct Writer(Vec<u8>);

impl Writer {
    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn u64(&mut self, v: u64) {
        if v < 128 {
            self.0.push(v as u8);
        } else if v <= u64::from(u8::MAX) {
            self.0.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u64::from(u16::MAX) {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u64::from(u32::MAX) {
            self.0.push(0xce);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn i64(&mut self, v: i64) {
        if let Ok(u) = u64::try_from(v) {
            self.u64(u);
        } else if v >= -32 {
            self.0.push(v as i8 as u8);
        } else if v >= i64::from(i8::MIN) {
            self.0.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i64::from(i16::MIN) {
            self.0.push(0xd1);
            self.0.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.0.push(0xd2);
            self.0.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn opt_i64(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.i64(v),
            None => self.nil(),
        }
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    fn len_head(&mut self, len: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
        if len <= fix_max {
            self.0.push(fix | len as u8);
        } else if let Ok(len) = u16::try_from(len) {
            self.0.push(m16);
            self.0.extend_from_slice(&len.to_be_bytes());
        } else {
            self.0.push(m32);
            self.0.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }

    fn str(&mut self, s: &str) {
        let len = s.len();
        if len < 32 {
            self.0.push(0xa0 | len as u8);
        } else if let Ok(len) = u8::try_from(len) {
            self.0.extend_from_slice(&[0xd9, len]);
        } else if let Ok(len) = u16::try_from(len) {
            self.0.push(0xda);
            self.0.extend_from_slice(&len.to_be_bytes());
        } else {
            self.0.push(0xdb);
            self.0.extend_from_slice(&(len as u32).to_be_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    fn bin(&mut self, b: &[u8]) {
        if let Ok(len) = u8::try_from(b.len()) {
            self.0.extend_from_slice(&[0xc4, len]);
        } else if let Ok(len) = u16::try_from(b.len()) {
            self.0.push(0xc5);
            self.0.extend_from_slice(&len.to_be_bytes());
        } else {
            self.0.push(0xc6);
            self.0.extend_from_slice(&(b.len() as u32).to_be_bytes());
        }
        self.0.extend_from_slice(b);
    }

    fn array(&mut self, len: usize) {
        self.len_head(len, 0x90, 15, 0xdc, 0xdd);
    }

    fn map(&mut self, len: usize) {
        self.len_head(len, 0x80, 15, 0xde, 0xdf);
    }

    fn raw(&mut self, v: &RawValue) {
        self.0.extend_from_slice(&v.0);
    }

    fn hash(&mut self, h: &EngineHash) {
        match h {
            EngineHash::Int(v) => self.u64(*v),
            EngineHash::Digest(d) => self.bin(d.as_bytes()),
        }
    }

    fn hashes(&mut self, hashes: &[EngineHash]) {
        self.array(hashes.len());
        for h in hashes {
            self.hash(h);
        }
    }

    fn opt_hash(&mut self, h: Option<&EngineHash>) {
        match h {
            Some(h) => self.hash(h),
            None => self.nil(),
        }
    }

    fn tokens(&mut self, tokens: &[u32]) {
        self.array(tokens.len());
        for &t in tokens {
            self.u64(u64::from(t));
        }
    }

    fn extra_keys(&mut self, keys: &[Option<Vec<ExtraKey>>]) {
        self.array(keys.len());
        for block in keys {
            match block {
                None => self.nil(),
                Some(items) => {
                    self.array(items.len());
                    for item in items {
                        match item {
                            ExtraKey::Text(s) => self.str(s),
                            ExtraKey::Other(raw) => self.raw(raw),
                        }
                    }
                }
            }
        }
    }

    fn opt_extra_keys(&mut self, keys: Option<&[Option<Vec<ExtraKey>>]>) {
        match keys {
            Some(keys) => self.extra_keys(keys),
            None => self.nil(),
        }
    }

    fn stored_map(&mut self, e: &BlockStored) {
        let optional = [
            e.extra_keys.is_some(),
            e.group_idx.is_some(),
            e.kv_cache_spec_kind.is_some(),
            e.kv_cache_spec_sliding_window.is_some(),
            e.locality.is_some(),
            e.ownership.is_some(),
            e.session_id.is_some(),
            e.lookahead_token_ids.is_some(),
        ];
        let entries = 8 + optional.iter().filter(|p| **p).count();
        // msgspec sizes the header for all 16 possible keys: always map16.
        self.0.push(0xde);
        self.0.extend_from_slice(&(entries as u16).to_be_bytes());
        self.str("type");
        self.str("BlockStored");
        self.str("block_hashes");
        self.hashes(&e.block_hashes);
        self.str("parent_block_hash");
        self.opt_hash(e.parent_block_hash.as_ref());
        self.str("token_ids");
        self.tokens(&e.token_ids);
        self.str("block_size");
        self.u64(e.block_size);
        self.str("lora_id");
        self.opt_i64(e.lora_id);
        self.str("medium");
        self.opt_str(e.medium.as_deref());
        self.str("lora_name");
        self.opt_str(e.lora_name.as_deref());
        if let Some(keys) = &e.extra_keys {
            self.str("extra_keys");
            self.extra_keys(keys);
        }
        if let Some(v) = e.group_idx {
            self.str("group_idx");
            self.i64(v);
        }
        if let Some(v) = &e.kv_cache_spec_kind {
            self.str("kv_cache_spec_kind");
            self.str(v);
        }
        if let Some(v) = e.kv_cache_spec_sliding_window {
            self.str("kv_cache_spec_sliding_window");
            self.i64(v);
        }
        for (name, value) in [
            ("locality", &e.locality),
            ("ownership", &e.ownership),
            ("session_id", &e.session_id),
            ("lookahead_token_ids", &e.lookahead_token_ids),
        ] {
            if let Some(v) = value {
                self.str(name);
                self.raw(v);
            }
        }
    }

    fn stored_positional(&mut self, e: &BlockStored) {
        self.array(12);
        self.str("BlockStored");
        self.hashes(&e.block_hashes);
        self.opt_hash(e.parent_block_hash.as_ref());
        self.tokens(&e.token_ids);
        self.u64(e.block_size);
        self.opt_i64(e.lora_id);
        self.opt_str(e.medium.as_deref());
        self.opt_str(e.lora_name.as_deref());
        self.opt_extra_keys(e.extra_keys.as_deref());
        self.opt_i64(e.group_idx);
        self.opt_str(e.kv_cache_spec_kind.as_deref());
        self.opt_i64(e.kv_cache_spec_sliding_window);
    }

    fn removed_map(&mut self, e: &BlockRemoved) {
        let optional = [
            e.group_idx.is_some(),
            e.locality.is_some(),
            e.ownership.is_some(),
        ];
        self.map(3 + optional.iter().filter(|p| **p).count());
        self.str("type");
        self.str("BlockRemoved");
        self.str("block_hashes");
        self.hashes(&e.block_hashes);
        self.str("medium");
        self.opt_str(e.medium.as_deref());
        if let Some(v) = e.group_idx {
            self.str("group_idx");
            self.i64(v);
        }
        for (name, value) in [("locality", &e.locality), ("ownership", &e.ownership)] {
            if let Some(v) = value {
                self.str(name);
                self.raw(v);
            }
        }
    }

    fn removed_positional(&mut self, e: &BlockRemoved) {
        self.array(4);
        self.str("BlockRemoved");
        self.hashes(&e.block_hashes);
        self.opt_str(e.medium.as_deref());
        self.opt_i64(e.group_idx);
    }
}
