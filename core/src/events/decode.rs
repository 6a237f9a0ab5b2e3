//! A tolerant, panic-free decoder for vLLM's msgpack KV-event batches.
//!
//! Accepted, because some vLLM release sends it: map events (>= 0.24) and positional events
//! (<= 0.23), 2- and 3-element batches, any msgpack integer width, signed or unsigned hashes,
//! int or digest-bytes hashes. Ignored, so newer releases keep working: unknown map keys,
//! extra trailing fields, unknown event types (counted). Untrusted lengths never size an
//! allocation beyond the bytes actually present.

use rmp::Marker;

use super::{BlockRemoved, BlockStored, EngineHash, EventBatch, ExtraKey, KvEvent, RawValue};
use crate::keys::Digest;

/// Why a payload is not a KV-event batch. The whole batch is rejected: applying part of
/// it would leave the index in a state the replica never had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload ends inside a value.
    #[error("payload truncated at byte {0}")]
    Truncated(usize),
    /// A value has a type the field cannot hold.
    #[error("expected {expected} at byte {offset}")]
    Unexpected {
        /// What the field needs.
        expected: &'static str,
        /// Where the offending value starts.
        offset: usize,
    },
    /// A field every release sends is absent.
    #[error("{event} event has no {field}")]
    MissingField {
        /// The event type.
        event: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// Bytes follow the batch, so the frame is not what a publisher sent.
    #[error("{0} trailing bytes after the batch")]
    TrailingBytes(usize),
}

/// Decodes one published payload (the third frame of a live message).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut r = Reader {
        buf: payload,
        pos: 0,
    };
    let batch = r.batch()?;
    let rest = payload.len().saturating_sub(r.pos);
    if rest != 0 {
        return Err(DecodeError::TrailingBytes(rest));
    }
    Ok(batch)
}

/// Field order of positional `BlockStored` (vLLM <= 0.23; later fields for completeness).
const STORED_FIELDS: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];

/// Field order of positional `BlockRemoved`.
const REMOVED_FIELDS: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum EventType {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl EventType {
    fn from_tag(tag: &str) -> Self {
        match tag {
            "BlockStored" => Self::Stored,
            "BlockRemoved" => Self::Removed,
            "AllBlocksCleared" => Self::Cleared,
            _ => Self::Unknown,
        }
    }

    fn positional_fields(self) -> &'static [&'static str] {
        match self {
            Self::Stored => &STORED_FIELDS,
            Self::Removed => &REMOVED_FIELDS,
            Self::Cleared | Self::Unknown => &[],
        }
    }
}

/// Every field any event type has; filled by name, then checked per type.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u64>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    group_idx: Option<i64>,
    kv_cache_spec_kind: Option<String>,
    kv_cache_spec_sliding_window: Option<i64>,
    locality: Option<RawValue>,
    ownership: Option<RawValue>,
    session_id: Option<RawValue>,
    lookahead_token_ids: Option<RawValue>,
}

impl Fields {
    fn into_event(self, kind: EventType) -> Result<Option<KvEvent>, DecodeError> {
        Ok(Some(match kind {
            EventType::Stored => KvEvent::BlockStored(BlockStored {
                block_hashes: self
                    .block_hashes
                    .ok_or(missing("BlockStored", "block_hashes"))?,
                parent_block_hash: self.parent_block_hash,
                token_ids: self.token_ids.ok_or(missing("BlockStored", "token_ids"))?,
                block_size: self
                    .block_size
                    .ok_or(missing("BlockStored", "block_size"))?,
                lora_id: self.lora_id,
                medium: self.medium,
                lora_name: self.lora_name,
                extra_keys: self.extra_keys,
                group_idx: self.group_idx,
                kv_cache_spec_kind: self.kv_cache_spec_kind,
                kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window,
                locality: self.locality,
                ownership: self.ownership,
                session_id: self.session_id,
                lookahead_token_ids: self.lookahead_token_ids,
            }),
            EventType::Removed => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self
                    .block_hashes
                    .ok_or(missing("BlockRemoved", "block_hashes"))?,
                medium: self.medium,
                group_idx: self.group_idx,
                locality: self.locality,
                ownership: self.ownership,
            }),
            EventType::Cleared => KvEvent::AllBlocksCleared,
            EventType::Unknown => return Ok(None),
        }))
    }
}

fn missing(event: &'static str, field: &'static str) -> DecodeError {
    DecodeError::MissingField { event, field }
}

/// A msgpack integer, before the field decides which range it accepts.
enum Int {
    Unsigned(u64),
    Negative(i64),
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(DecodeError::Truncated(self.pos))?;
        let bytes = self
            .buf
            .get(self.pos..end)
            .ok_or(DecodeError::Truncated(self.pos))?;
        self.pos = end;
        Ok(bytes)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len16(&mut self) -> Result<usize, DecodeError> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn len32(&mut self) -> Result<usize, DecodeError> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    fn marker(&mut self) -> Result<Marker, DecodeError> {
        let byte = *self
            .buf
            .get(self.pos)
            .ok_or(DecodeError::Truncated(self.pos))?;
        self.pos += 1;
        Ok(Marker::from_u8(byte))
    }

    fn unexpected(&self, start: usize, expected: &'static str) -> DecodeError {
        DecodeError::Unexpected {
            expected,
            offset: start,
        }
    }

    /// Consumes a nil if one is next.
    fn nil(&mut self) -> bool {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn int(&mut self, expected: &'static str) -> Result<Int, DecodeError> {
        let start = self.pos;
        Ok(match self.marker()? {
            Marker::FixPos(v) => Int::Unsigned(u64::from(v)),
            Marker::FixNeg(v) => Int::Negative(i64::from(v)),
            Marker::U8 => Int::Unsigned(u64::from(u8::from_be_bytes(self.be()?))),
            Marker::U16 => Int::Unsigned(u64::from(u16::from_be_bytes(self.be()?))),
            Marker::U32 => Int::Unsigned(u64::from(u32::from_be_bytes(self.be()?))),
            Marker::U64 => Int::Unsigned(u64::from_be_bytes(self.be()?)),
            Marker::I8 => signed(i64::from(i8::from_be_bytes(self.be()?))),
            Marker::I16 => signed(i64::from(i16::from_be_bytes(self.be()?))),
            Marker::I32 => signed(i64::from(i32::from_be_bytes(self.be()?))),
            Marker::I64 => signed(i64::from_be_bytes(self.be()?)),
            _ => return Err(self.unexpected(start, expected)),
        })
    }

    fn i64(&mut self, expected: &'static str) -> Result<i64, DecodeError> {
        let start = self.pos;
        match self.int(expected)? {
            Int::Negative(v) => Ok(v),
            Int::Unsigned(v) => i64::try_from(v).map_err(|_| self.unexpected(start, expected)),
        }
    }

    fn u64(&mut self, expected: &'static str) -> Result<u64, DecodeError> {
        let start = self.pos;
        match self.int(expected)? {
            Int::Unsigned(v) => Ok(v),
            Int::Negative(_) => Err(self.unexpected(start, expected)),
        }
    }

    fn opt_i64(&mut self, expected: &'static str) -> Result<Option<i64>, DecodeError> {
        if self.nil() {
            return Ok(None);
        }
        self.i64(expected).map(Some)
    }

    fn f64(&mut self) -> Result<f64, DecodeError> {
        let start = self.pos;
        match Marker::from_u8(*self.buf.get(start).ok_or(DecodeError::Truncated(start))?) {
            Marker::F64 => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            Marker::F32 => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            _ => match self.int("a timestamp")? {
                Int::Unsigned(v) => Ok(v as f64),
                Int::Negative(v) => Ok(v as f64),
            },
        }
    }

    fn str(&mut self, expected: &'static str) -> Result<&'a str, DecodeError> {
        let start = self.pos;
        let len = match self.marker()? {
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 => usize::from(u8::from_be_bytes(self.be()?)),
            Marker::Str16 => self.len16()?,
            Marker::Str32 => self.len32()?,
            _ => return Err(self.unexpected(start, expected)),
        };
        std::str::from_utf8(self.take(len)?).map_err(|_| self.unexpected(start, expected))
    }

    fn opt_string(&mut self, expected: &'static str) -> Result<Option<String>, DecodeError> {
        if self.nil() {
            return Ok(None);
        }
        self.str(expected).map(|s| Some(s.to_owned()))
    }

    fn bin(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        let len = match Marker::from_u8(
            *self
                .buf
                .get(self.pos)
                .ok_or(DecodeError::Truncated(self.pos))?,
        ) {
            Marker::Bin8 => {
                self.pos += 1;
                usize::from(u8::from_be_bytes(self.be()?))
            }
            Marker::Bin16 => {
                self.pos += 1;
                self.len16()?
            }
            Marker::Bin32 => {
                self.pos += 1;
                self.len32()?
            }
            _ => return Ok(None),
        };
        self.take(len).map(Some)
    }

    fn array_len(&mut self, expected: &'static str) -> Result<usize, DecodeError> {
        let start = self.pos;
        let len = match self.marker()? {
            Marker::FixArray(n) => usize::from(n),
            Marker::Array16 => self.len16()?,
            Marker::Array32 => self.len32()?,
            _ => return Err(self.unexpected(start, expected)),
        };
        self.bounded(len)
    }

    fn map_len(&mut self) -> Result<Option<usize>, DecodeError> {
        let len = match Marker::from_u8(
            *self
                .buf
                .get(self.pos)
                .ok_or(DecodeError::Truncated(self.pos))?,
        ) {
            Marker::FixMap(n) => {
                self.pos += 1;
                usize::from(n)
            }
            Marker::Map16 => {
                self.pos += 1;
                self.len16()?
            }
            Marker::Map32 => {
                self.pos += 1;
                self.len32()?
            }
            _ => return Ok(None),
        };
        self.bounded(len).map(Some)
    }

    /// A claimed element count, refused if the remaining bytes cannot hold that many
    /// (every element takes at least one byte), so no allocation trusts the wire.
    fn bounded(&self, len: usize) -> Result<usize, DecodeError> {
        if len > self.buf.len().saturating_sub(self.pos) {
            return Err(DecodeError::Truncated(self.pos));
        }
        Ok(len)
    }

    /// Skips one value of any type without recursion, so nesting depth cannot overflow
    /// the stack.
    fn skip(&mut self) -> Result<(), DecodeError> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let children: u64 = match self.marker()? {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False
                | Marker::Reserved => 0,
                Marker::U8 | Marker::I8 => self.take(1).map(|_| 0)?,
                Marker::U16 | Marker::I16 => self.take(2).map(|_| 0)?,
                Marker::U32 | Marker::I32 | Marker::F32 => self.take(4).map(|_| 0)?,
                Marker::U64 | Marker::I64 | Marker::F64 => self.take(8).map(|_| 0)?,
                Marker::FixStr(n) => self.take(usize::from(n)).map(|_| 0)?,
                Marker::Str8 | Marker::Bin8 => {
                    let n = usize::from(u8::from_be_bytes(self.be()?));
                    self.take(n).map(|_| 0)?
                }
                Marker::Str16 | Marker::Bin16 => {
                    let n = self.len16()?;
                    self.take(n).map(|_| 0)?
                }
                Marker::Str32 | Marker::Bin32 => {
                    let n = self.len32()?;
                    self.take(n).map(|_| 0)?
                }
                Marker::FixArray(n) => u64::from(n),
                Marker::Array16 => self.len16()? as u64,
                Marker::Array32 => self.len32()? as u64,
                Marker::FixMap(n) => 2 * u64::from(n),
                Marker::Map16 => 2 * self.len16()? as u64,
                Marker::Map32 => 2 * self.len32()? as u64,
                Marker::FixExt1 => self.take(2).map(|_| 0)?,
                Marker::FixExt2 => self.take(3).map(|_| 0)?,
                Marker::FixExt4 => self.take(5).map(|_| 0)?,
                Marker::FixExt8 => self.take(9).map(|_| 0)?,
                Marker::FixExt16 => self.take(17).map(|_| 0)?,
                Marker::Ext8 => {
                    let n = usize::from(u8::from_be_bytes(self.be()?));
                    self.take(n + 1).map(|_| 0)?
                }
                Marker::Ext16 => {
                    let n = self.len16()?;
                    self.take(n + 1).map(|_| 0)?
                }
                Marker::Ext32 => {
                    let n = self.len32()?;
                    self.take(n.saturating_add(1)).map(|_| 0)?
                }
            };
            pending = pending.saturating_add(children);
        }
        Ok(())
    }

    fn raw(&mut self) -> Result<RawValue, DecodeError> {
        let start = self.pos;
        self.skip()?;
        Ok(RawValue(
            self.buf.get(start..self.pos).unwrap_or(&[]).to_vec(),
        ))
    }

    fn opt_raw(&mut self) -> Result<Option<RawValue>, DecodeError> {
        if self.nil() {
            return Ok(None);
        }
        self.raw().map(Some)
    }

    fn hash(&mut self) -> Result<EngineHash, DecodeError> {
        let start = self.pos;
        if let Some(bytes) = self.bin()? {
            return Digest::from_slice(bytes)
                .map(EngineHash::Digest)
                .ok_or_else(|| self.unexpected(start, "a 1-32 byte block hash"));
        }
        Ok(EngineHash::Int(match self.int("a block hash")? {
            Int::Unsigned(v) => v,
            Int::Negative(v) => v as u64,
        }))
    }

    fn hashes(&mut self) -> Result<Vec<EngineHash>, DecodeError> {
        let len = self.array_len("an array of block hashes")?;
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            out.push(self.hash()?);
        }
        Ok(out)
    }

    /// Token ids: nearly all the bytes of a busy replica's events. A purpose-built loop over
    /// the four unsigned forms msgspec writes for token ids; it took the decode bench
    /// (`cargo xtask bench core`) from 1.7 to 6.2 M block entries/s over the
    /// generic `u64()` path, which stays the fallback for every other form.
    fn tokens(&mut self) -> Result<Vec<u32>, DecodeError> {
        let len = self.array_len("an array of token ids")?;
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            let pos = self.pos;
            let fast = match self.buf.get(pos) {
                Some(&b) if b < 0x80 => Some((u32::from(b), 1)),
                Some(0xcc) => self.buf.get(pos + 1).map(|b| (u32::from(*b), 2)),
                Some(0xcd) => self
                    .buf
                    .get(pos + 1..pos + 3)
                    .and_then(|b| b.try_into().ok())
                    .map(|b: [u8; 2]| (u32::from(u16::from_be_bytes(b)), 3)),
                Some(0xce) => self
                    .buf
                    .get(pos + 1..pos + 5)
                    .and_then(|b| b.try_into().ok())
                    .map(|b: [u8; 4]| (u32::from_be_bytes(b), 5)),
                _ => None,
            };
            match fast {
                Some((token, width)) => {
                    self.pos = pos + width;
                    out.push(token);
                }
                None => {
                    let token = self.u64("a token id")?;
                    out.push(
                        u32::try_from(token).map_err(|_| self.unexpected(pos, "a u32 token id"))?,
                    );
                }
            }
        }
        Ok(out)
    }

    fn extra_keys(&mut self) -> Result<Option<Vec<Option<Vec<ExtraKey>>>>, DecodeError> {
        if self.nil() {
            return Ok(None);
        }
        let blocks = self.array_len("an array of per-block extra keys")?;
        let mut out = Vec::with_capacity(blocks);
        for _ in 0..blocks {
            if self.nil() {
                out.push(None);
                continue;
            }
            let items = self.array_len("a block's extra keys")?;
            let mut keys = Vec::with_capacity(items);
            for _ in 0..items {
                let start = self.pos;
                match self.str("") {
                    Ok(text) => keys.push(ExtraKey::Text(text.to_owned())),
                    Err(_) => {
                        self.pos = start;
                        keys.push(ExtraKey::Other(self.raw()?));
                    }
                }
            }
            out.push(Some(keys));
        }
        Ok(Some(out))
    }

    fn field(&mut self, name: &str, f: &mut Fields) -> Result<(), DecodeError> {
        match name {
            "block_hashes" => f.block_hashes = Some(self.hashes()?),
            "parent_block_hash" => {
                f.parent_block_hash = if self.nil() { None } else { Some(self.hash()?) }
            }
            "token_ids" => f.token_ids = Some(self.tokens()?),
            "block_size" => f.block_size = Some(self.u64("a block size")?),
            "lora_id" => f.lora_id = self.opt_i64("a LoRA id")?,
            "medium" => f.medium = self.opt_string("a medium name")?,
            "lora_name" => f.lora_name = self.opt_string("a LoRA name")?,
            "extra_keys" => f.extra_keys = self.extra_keys()?,
            "group_idx" => f.group_idx = self.opt_i64("a group index")?,
            "kv_cache_spec_kind" => {
                f.kv_cache_spec_kind = self.opt_string("a KV-cache spec kind")?
            }
            "kv_cache_spec_sliding_window" => {
                f.kv_cache_spec_sliding_window = self.opt_i64("a sliding-window size")?
            }
            "locality" => f.locality = self.opt_raw()?,
            "ownership" => f.ownership = self.opt_raw()?,
            "session_id" => f.session_id = self.opt_raw()?,
            "lookahead_token_ids" => f.lookahead_token_ids = self.opt_raw()?,
            _ => self.skip()?,
        }
        Ok(())
    }

    /// One event; `None` for an unknown type, which has been skipped whole.
    fn event(&mut self) -> Result<Option<KvEvent>, DecodeError> {
        let mut fields = Fields::default();
        if let Some(entries) = self.map_len()? {
            let mut kind = None;
            for _ in 0..entries {
                let key_start = self.pos;
                let Ok(key) = self.str("") else {
                    self.pos = key_start;
                    self.skip()?;
                    self.skip()?;
                    continue;
                };
                if key == "type" {
                    kind = Some(EventType::from_tag(self.str("an event type name")?));
                } else if kind == Some(EventType::Unknown) {
                    self.skip()?;
                } else {
                    self.field(key, &mut fields)?;
                }
            }
            let kind = kind.ok_or(missing("map", "type"))?;
            return fields.into_event(kind);
        }
        let len = self.array_len("an event (map or array)")?;
        if len == 0 {
            return Err(missing("positional", "type"));
        }
        let kind = EventType::from_tag(self.str("an event type name")?);
        let names = kind.positional_fields();
        for index in 1..len {
            match names.get(index - 1) {
                Some(name) => self.field(name, &mut fields)?,
                None => self.skip()?,
            }
        }
        fields.into_event(kind)
    }

    fn batch(&mut self) -> Result<EventBatch, DecodeError> {
        let start = self.pos;
        let len = self.array_len("a batch array")?;
        if len < 2 {
            return Err(self.unexpected(start, "a batch of [ts, events, dp_rank]"));
        }
        let ts = self.f64()?;
        let count = self.array_len("an array of events")?;
        let mut events = Vec::with_capacity(count);
        let mut skipped_unknown = 0u32;
        for _ in 0..count {
            match self.event()? {
                Some(event) => events.push(event),
                None => skipped_unknown = skipped_unknown.saturating_add(1),
            }
        }
        let data_parallel_rank = if len >= 3 {
            self.opt_i64("a data-parallel rank")?
        } else {
            None
        };
        for _ in 3..len {
            self.skip()?;
        }
        Ok(EventBatch {
            ts,
            events,
            data_parallel_rank,
            skipped_unknown,
        })
    }
}

fn signed(v: i64) -> Int {
    match u64::try_from(v) {
        Ok(u) => Int::Unsigned(u),
        Err(_) => Int::Negative(v),
    }
}
