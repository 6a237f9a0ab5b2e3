//! Endpoint slots and the sets of them every index keeps per key.
//!
//! A daemon follows up to [`MAX_SLOTS`] event streams. Most blocks are held by one replica
//! or a few (affinity routing keeps a prefix where it started), a hot system prompt by all
//! of them, and a small fleet by at most a few dozen: so a key's holders are packed in one
//! 64-bit word ([`Holders`]): the bitmask it always was for slots below 63, else up to
//! five slot numbers, else a handle to a record of eight or a full bitmap aside
//! ([`Spill`]). A table entry stays 16 bytes at any fleet size, and a fleet of up to 63
//! streams runs the bitmask path it always did.

/// Event streams one daemon follows: one bit each in a [`SlotSet`].
pub const MAX_SLOTS: usize = 1024;

const WORDS: usize = MAX_SLOTS / 64;

/// An endpoint's position in the holder sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(u16);

impl Slot {
    /// The slot numbered `n`, if within [`MAX_SLOTS`].
    pub fn new(n: usize) -> Option<Self> {
        (n < MAX_SLOTS).then_some(Self(n as u16))
    }

    /// Its number.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    fn word(self) -> usize {
        self.index() / 64
    }

    fn bit(self) -> u64 {
        1 << (self.0 % 64)
    }
}

/// A set of slots as a bitmap, with a mask of the words that may be non-zero so that a
/// small fleet's sets touch one word of sixteen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotSet {
    words: [u64; WORDS],
    /// Bit `w` set when `words[w]` may be non-zero.
    used: u16,
}

impl SlotSet {
    /// Adds `slot`; true if it was not in the set.
    pub fn insert(&mut self, slot: Slot) -> bool {
        let Some(word) = self.words.get_mut(slot.word()) else {
            return false;
        };
        let new = *word & slot.bit() == 0;
        *word |= slot.bit();
        self.used |= 1 << slot.word();
        new
    }

    /// Removes `slot`; true if it was in the set.
    pub fn remove(&mut self, slot: Slot) -> bool {
        let Some(word) = self.words.get_mut(slot.word()) else {
            return false;
        };
        let held = *word & slot.bit() != 0;
        *word &= !slot.bit();
        held
    }

    /// Whether `slot` is in the set.
    pub fn contains(&self, slot: Slot) -> bool {
        self.words
            .get(slot.word())
            .is_some_and(|w| w & slot.bit() != 0)
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.used_words().all(|w| self.word(w) == 0)
    }

    /// Slots in the set.
    pub fn len(&self) -> usize {
        self.used_words()
            .map(|w| self.word(w).count_ones() as usize)
            .sum()
    }

    /// The slots in the set, in order.
    pub fn iter(&self) -> impl Iterator<Item = Slot> + '_ {
        self.used_words()
            .flat_map(move |w| bits(self.word(w)).filter_map(move |b| Slot::new(w * 64 + b)))
    }

    /// The lowest slot not in the set.
    pub fn first_absent(&self) -> Option<Slot> {
        self.words
            .iter()
            .enumerate()
            .find(|(_, w)| **w != u64::MAX)
            .and_then(|(i, w)| Slot::new(i * 64 + w.trailing_ones() as usize))
    }

    /// Empties the set, writing only the words it used.
    pub fn clear(&mut self) {
        for w in bits(u64::from(self.used)) {
            if let Some(word) = self.words.get_mut(w) {
                *word = 0;
            }
        }
        self.used = 0;
    }

    fn or_word(&mut self, w: usize, bits: u64) {
        if bits == 0 {
            return;
        }
        if let Some(word) = self.words.get_mut(w) {
            *word |= bits;
            self.used |= 1 << w;
        }
    }

    fn word(&self, w: usize) -> u64 {
        self.words.get(w).copied().unwrap_or(0)
    }

    fn used_words(&self) -> impl Iterator<Item = usize> {
        bits(u64::from(self.used))
    }
}

impl FromIterator<Slot> for SlotSet {
    fn from_iter<I: IntoIterator<Item = Slot>>(slots: I) -> Self {
        let mut set = Self::default();
        for slot in slots {
            set.insert(slot);
        }
        set
    }
}

/// The positions of the bits set in `word`, lowest first.
fn bits(mut word: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (word != 0).then(|| {
            let b = word.trailing_zeros() as usize;
            word &= word - 1;
            b
        })
    })
}

/// One key's holders in 8 bytes: a bitmask of slots below 63, or up to five slot numbers,
/// or a handle to a record of up to eight or to a bitmap in a [`Spill`]. Always the first
/// of these that fits, so an empty set is 0 and equal sets pack alike. Read and changed
/// only through the [`Spill`] of the table that holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Holders(u64);

/// How a [`Holders`] word is read: its top bits say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Top bit 0: the other 63 are slots 0..63.
    Mask,
    /// Top bits 10: [`INLINE`] slot numbers of ten bits each, their count above them.
    Inline,
    /// Top bits 110: a [`Record`] in the spill, its index in the low 32 bits.
    Record(usize),
    /// Top bits 111: a bitmap in the spill, its index in the low 32 bits.
    Bitmap(usize),
}

/// Slots a [`Holders`] mask covers.
const MASK_SLOTS: usize = 63;
/// Slot numbers a [`Holders`] word packs, ten bits each, with their count above them.
const INLINE: usize = 5;
const ID_BITS: u32 = 10;
const COUNT_SHIFT: u32 = ID_BITS * INLINE as u32;
const INLINE_TAG: u64 = 0b10 << 62;
const RECORD_TAG: u64 = 0b110 << 61;
const BITMAP_TAG: u64 = 0b111 << 61;
/// Slot numbers a spilled record holds: a block on up to eight replicas costs 16 bytes
/// aside, not a 128-byte bitmap, and a walk reads one cache line for it.
const RECORD: usize = 8;
/// A record's unused places.
const NO_SLOT: u16 = u16::MAX;

type Record = [u16; RECORD];

impl Holders {
    /// Whether no slot holds the key.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    fn kind(self) -> Kind {
        let index = (self.0 & u64::from(u32::MAX)) as usize;
        match self.0 >> 61 {
            0..=0b011 => Kind::Mask,
            0b100 | 0b101 => Kind::Inline,
            0b110 => Kind::Record(index),
            _ => Kind::Bitmap(index),
        }
    }

    fn inline(self) -> impl Iterator<Item = Slot> {
        let count = (self.0 >> COUNT_SHIFT) & 0b111;
        (0..count).filter_map(move |i| {
            let id = (self.0 >> (i as u32 * ID_BITS)) & ((1 << ID_BITS) - 1);
            Slot::new(id as usize)
        })
    }
}

/// Records and bitmaps of a table, interned: keys with the same holders (every block of a
/// prefix the same replicas cached) share one, counted, so a walk along a prefix reads the
/// same cache line for every key, and a shared set costs its bytes once. A set in use is
/// never changed in place: a key that gains or loses a holder moves to another.
#[derive(Debug)]
struct Arena<T> {
    /// Each place's set and how many keys use it (0: free).
    items: Vec<(T, u32)>,
    free: Vec<u32>,
    /// Where each set in use is.
    places: std::collections::HashMap<T, u32, foldhash::fast::FixedState>,
}

impl<T: Copy + Eq + std::hash::Hash> Arena<T> {
    const fn new() -> Self {
        Self {
            items: Vec::new(),
            free: Vec::new(),
            places: std::collections::HashMap::with_hasher(foldhash::fast::FixedState::with_seed(
                0x6b76_6166_6669_6e65,
            )),
        }
    }

    /// The place of `item`, now used by one more key.
    fn intern(&mut self, item: T) -> usize {
        if let Some(&i) = self.places.get(&item) {
            if let Some((_, uses)) = self.items.get_mut(i as usize) {
                *uses += 1;
            }
            return i as usize;
        }
        let i = match self.free.pop() {
            Some(i) => {
                if let Some(place) = self.items.get_mut(i as usize) {
                    *place = (item, 1);
                }
                i
            }
            None => {
                self.items.push((item, 1));
                (self.items.len() - 1) as u32
            }
        };
        self.places.insert(item, i);
        i as usize
    }

    /// Place `i` is used by one key fewer; freed when none uses it.
    fn release(&mut self, i: usize) {
        let Some((item, uses)) = self.items.get_mut(i) else {
            return;
        };
        *uses = uses.saturating_sub(1);
        if *uses == 0 {
            self.places.remove(item);
            self.free.push(i as u32);
        }
    }

    fn get(&self, i: usize) -> Option<&T> {
        self.items.get(i).map(|(item, _)| item)
    }

    /// Sets in use.
    fn live(&self) -> usize {
        self.places.len()
    }

    fn bytes(&self) -> usize {
        let place = std::mem::size_of::<(T, u32)>();
        self.items.capacity() * place
            + self.free.capacity() * std::mem::size_of::<u32>()
            + self.places.capacity() * (std::mem::size_of::<(T, u32)>() + 1) * 8 / 7
    }
}

/// The holder sets of one table's keys that do not fit in a [`Holders`] word.
#[derive(Debug)]
pub struct Spill {
    records: Arena<Record>,
    bitmaps: Arena<[u64; WORDS]>,
}

impl Default for Spill {
    fn default() -> Self {
        Self::new()
    }
}

/// A spill with nothing in it, for views of tables that do not exist.
pub static NO_SPILL: Spill = Spill::new();

impl Spill {
    const fn new() -> Self {
        Self {
            records: Arena::new(),
            bitmaps: Arena::new(),
        }
    }

    /// Adds `slot` to `holders`; true if it was not there.
    pub fn insert(&mut self, holders: &mut Holders, slot: Slot) -> bool {
        match holders.kind() {
            Kind::Mask if slot.index() < MASK_SLOTS => {
                let new = holders.0 & slot.bit() == 0;
                holders.0 |= slot.bit();
                new
            }
            _ => {
                let mut set = self.expand(*holders);
                let new = set.insert(slot);
                if new {
                    *holders = self.pack(&set, *holders);
                }
                new
            }
        }
    }

    /// Takes `slot` out of `holders`; true if it was there.
    pub fn remove(&mut self, holders: &mut Holders, slot: Slot) -> bool {
        if holders.kind() == Kind::Mask {
            let held = slot.index() < MASK_SLOTS && holders.0 & slot.bit() != 0;
            holders.0 &= !(slot.bit() * u64::from(held));
            return held;
        }
        let mut set = self.expand(*holders);
        let held = set.remove(slot);
        if held {
            *holders = self.pack(&set, *holders);
        }
        held
    }

    /// Whether `slot` is one of `holders`.
    pub fn contains(&self, holders: Holders, slot: Slot) -> bool {
        match holders.kind() {
            Kind::Mask => slot.index() < MASK_SLOTS && holders.0 & slot.bit() != 0,
            Kind::Inline => holders.inline().any(|s| s == slot),
            Kind::Record(i) => self.records.get(i).is_some_and(|r| r.contains(&slot.0)),
            Kind::Bitmap(i) => self
                .bitmaps
                .get(i)
                .and_then(|set| set.get(slot.word()))
                .is_some_and(|w| w & slot.bit() != 0),
        }
    }

    /// Adds `holders` to `set`.
    pub fn add_to(&self, holders: Holders, set: &mut SlotSet) {
        match holders.kind() {
            Kind::Mask => set.or_word(0, holders.0),
            Kind::Inline => holders.inline().for_each(|s| {
                set.insert(s);
            }),
            Kind::Record(i) => {
                for id in self.records.get(i).into_iter().flatten() {
                    if let Some(s) = Slot::new(usize::from(*id)) {
                        set.insert(s);
                    }
                }
            }
            Kind::Bitmap(i) => {
                for (w, bits) in self.bitmaps.get(i).into_iter().flatten().enumerate() {
                    set.or_word(w, *bits);
                }
            }
        }
    }

    /// Holders among slots 0..64, as bits, of holders that are not a mask.
    #[cold]
    fn low_spilled(&self, holders: Holders) -> u64 {
        let low = |ids: &mut dyn Iterator<Item = Slot>| {
            ids.filter(|s| s.word() == 0)
                .fold(0, |bits, s| bits | s.bit())
        };
        match holders.kind() {
            Kind::Mask => holders.0,
            Kind::Inline => low(&mut holders.inline()),
            Kind::Record(i) => low(&mut self
                .records
                .get(i)
                .into_iter()
                .flatten()
                .filter_map(|id| Slot::new(usize::from(*id)))),
            Kind::Bitmap(i) => self
                .bitmaps
                .get(i)
                .map_or(0, |set| set.first().copied().unwrap_or(0)),
        }
    }

    /// Frees what `holders` keeps here (its key left the table).
    pub fn release(&mut self, holders: Holders) {
        match holders.kind() {
            Kind::Record(i) => self.records.release(i),
            Kind::Bitmap(i) => self.bitmaps.release(i),
            Kind::Mask | Kind::Inline => {}
        }
    }

    /// Keys whose holders are kept here.
    pub fn len(&self) -> usize {
        self.records.live() + self.bitmaps.live()
    }

    /// Whether no key's holders are kept here.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the records and bitmaps take.
    pub fn bytes(&self) -> usize {
        self.records.bytes() + self.bitmaps.bytes()
    }

    fn expand(&self, holders: Holders) -> SlotSet {
        let mut set = SlotSet::default();
        self.add_to(holders, &mut set);
        set
    }

    /// `set` packed in the first form that fits, `old` released.
    fn pack(&mut self, set: &SlotSet, old: Holders) -> Holders {
        let high = set.words.iter().skip(1).any(|w| *w != 0) || set.word(0) >> MASK_SLOTS != 0;
        let len = set.len();
        if !high || len <= INLINE {
            self.release(old);
            if !high {
                return Holders(set.word(0));
            }
            let mut packed = INLINE_TAG | ((len as u64) << COUNT_SHIFT);
            for (i, slot) in set.iter().enumerate() {
                packed |= (slot.index() as u64) << (i as u32 * ID_BITS);
            }
            return Holders(packed);
        }
        // The new set is interned before the old one is released, so a set that did not
        // change keeps its place.
        let packed = if len <= RECORD {
            let mut record = [NO_SLOT; RECORD];
            for (place, slot) in record.iter_mut().zip(set.iter()) {
                *place = slot.0;
            }
            Holders(RECORD_TAG | self.records.intern(record) as u64)
        } else {
            Holders(BITMAP_TAG | self.bitmaps.intern(set.words) as u64)
        };
        self.release(old);
        packed
    }
}

/// One key's holders as a walk reads them: one probe per key, then as many membership
/// tests as the walk needs.
pub trait HeldBy {
    /// Holders among slots 0..64, as bits.
    fn low(&self) -> u64;
    /// Whether `slot` holds the key.
    fn contains(&self, slot: Slot) -> bool;
    /// Adds every holder to `set`.
    fn add_to(&self, set: &mut SlotSet);
    /// Keeps the slots of `live` that hold the key, telling `dropped` of each other one.
    fn retain(&self, live: &mut Vec<Slot>, dropped: impl FnMut(Slot)) {
        keep(live, |slot| self.contains(slot), dropped);
    }
    /// Loads what [`retain`](Self::retain) will read from memory, so that reads for
    /// several keys can be under way at once.
    fn touch(&self) {}
    /// Whether `other` is known to hold exactly the slots this holds (false when unsure):
    /// a prefix's blocks cached by the same replicas share one interned set.
    fn same_as(&self, _other: &Self) -> bool {
        false
    }
}

/// Keeps the slots of `live` that are `held`, telling `dropped` of each other one; order
/// is not kept.
fn keep(live: &mut Vec<Slot>, held: impl Fn(Slot) -> bool, mut dropped: impl FnMut(Slot)) {
    let mut i = 0;
    while let Some(&slot) = live.get(i) {
        if held(slot) {
            i += 1;
        } else {
            live.swap_remove(i);
            dropped(slot);
        }
    }
}

/// A key's [`Holders`] with the [`Spill`] they may point into.
#[derive(Clone, Copy, Debug)]
pub struct HolderView<'a> {
    /// The packed holders (empty when the key is not held).
    pub holders: Holders,
    /// The table's spilled records and bitmaps.
    pub spill: &'a Spill,
}

impl HeldBy for HolderView<'_> {
    #[inline]
    fn low(&self) -> u64 {
        if self.holders.0 >> 63 == 0 {
            self.holders.0
        } else {
            self.spill.low_spilled(self.holders)
        }
    }

    fn contains(&self, slot: Slot) -> bool {
        self.spill.contains(self.holders, slot)
    }

    fn add_to(&self, set: &mut SlotSet) {
        self.spill.add_to(self.holders, set);
    }

    fn touch(&self) {
        match self.holders.kind() {
            Kind::Record(i) => {
                std::hint::black_box(self.spill.records.get(i).map(|r| r[0]));
            }
            Kind::Bitmap(i) => {
                std::hint::black_box(self.spill.bitmaps.get(i).map(|b| b[0]));
            }
            Kind::Mask | Kind::Inline => {}
        }
    }

    fn same_as(&self, other: &Self) -> bool {
        self.holders == other.holders && std::ptr::eq(self.spill, other.spill)
    }

    /// The record or bitmap is found once for every slot tested.
    fn retain(&self, live: &mut Vec<Slot>, dropped: impl FnMut(Slot)) {
        match self.holders.kind() {
            Kind::Record(i) => {
                let record = self.spill.records.get(i).copied();
                let record = record.unwrap_or([NO_SLOT; RECORD]);
                keep(live, |slot| record.contains(&slot.0), dropped);
            }
            Kind::Bitmap(i) => {
                let bitmap = self.spill.bitmaps.get(i);
                let held = |slot: Slot| {
                    bitmap
                        .and_then(|b| b.get(slot.word()))
                        .is_some_and(|w| w & slot.bit() != 0)
                };
                keep(live, held, dropped);
            }
            Kind::Inline => {
                let (packed, count) = (self.holders.0, (self.holders.0 >> COUNT_SHIFT) & 0b111);
                let held = |slot: Slot| {
                    (0..count)
                        .any(|i| (packed >> (i as u32 * ID_BITS)) & 0x3ff == u64::from(slot.0))
                };
                keep(live, held, dropped);
            }
            Kind::Mask => keep(live, |slot| self.contains(slot), dropped),
        }
    }
}

/// Holders of either view: KV events and bookings over them.
impl<A: HeldBy, B: HeldBy> HeldBy for (A, B) {
    fn low(&self) -> u64 {
        self.0.low() | self.1.low()
    }

    fn contains(&self, slot: Slot) -> bool {
        self.0.contains(slot) || self.1.contains(slot)
    }

    fn add_to(&self, set: &mut SlotSet) {
        self.0.add_to(set);
        self.1.add_to(set);
    }
}

/// Leading blocks held per slot: what a walk found. Slots below 64 live inline, so a
/// small fleet's walk allocates nothing; the rest grow to the highest slot recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Depths {
    low: [u32; 64],
    high: Vec<u32>,
}

impl Default for Depths {
    fn default() -> Self {
        Self {
            low: [0; 64],
            high: Vec::new(),
        }
    }
}

impl Depths {
    /// Slot `n`'s depth (0 if never recorded).
    pub fn get(&self, n: usize) -> u32 {
        match n.checked_sub(64) {
            None => self.low.get(n).copied().unwrap_or(0),
            Some(h) => self.high.get(h).copied().unwrap_or(0),
        }
    }

    /// Sets slot `n`'s depth.
    pub fn set(&mut self, n: usize, depth: u32) {
        let (cells, i) = match n.checked_sub(64) {
            None => (&mut self.low[..], n),
            Some(h) => {
                if h >= self.high.len() {
                    if depth == 0 {
                        return;
                    }
                    self.high.resize(h + 1, 0);
                }
                (&mut self.high[..], h)
            }
        };
        if let Some(d) = cells.get_mut(i) {
            *d = depth;
        }
    }

    /// Sets `depth` for the slots `64 * word + b` of each bit `b` set in `bits`.
    fn set_bits(&mut self, word: usize, bits_set: u64, depth: u32) {
        for b in bits(bits_set) {
            self.set(word * 64 + b, depth);
        }
    }
}

/// The most slots a walk tests one by one: each key costs one membership test per slot.
const FEW: usize = 16;
/// Keys a walk of few slots reads before testing them.
const BATCH: usize = 8;

/// For every slot, how many of `keys` it holds contiguously from the first, where
/// `holders(key)` reads the key's holders: the one walk every index (KV events, bookings
/// over them, the approximate history) is asked through. One probe per key, stopping when
/// no slot still matches. The slots still matching only ever shrink, so the walk picks its
/// loop once, by the first key's holders: one AND of two words per key while all are below
/// 63 (every small fleet, as fast as the 64-slot index was: `docs/benchmarks/scale.md`),
/// a membership test per slot while few (one cache line of a spilled record or bitmap),
/// else bitmaps until few remain.
pub fn longest_prefixes_by<H: HeldBy>(
    keys: impl IntoIterator<Item = u64>,
    mut holders: impl FnMut(u64) -> H,
) -> Depths {
    let mut depths = Depths::default();
    let mut keys = keys.into_iter();
    let Some(first) = keys.next() else {
        return depths;
    };
    let mut alive = SlotSet::default();
    holders(first).add_to(&mut alive);
    let mut depth = 1u32;
    let mut here = SlotSet::default();
    while alive.len() > FEW {
        let Some(key) = keys.next() else {
            alive.iter().for_each(|s| depths.set(s.index(), depth));
            return depths;
        };
        here.clear();
        holders(key).add_to(&mut here);
        let mut used = 0u16;
        for w in bits(u64::from(alive.used)) {
            let (Some(word), Some(next)) = (alive.words.get_mut(w), here.words.get(w)) else {
                continue;
            };
            let kept = *word & next;
            depths.set_bits(w, *word & !kept, depth);
            *word = kept;
            if kept != 0 {
                used |= 1 << w;
            }
        }
        alive.used = used;
        depth += 1;
    }
    if alive.used & !1 == 0 && alive.word(0) >> MASK_SLOTS == 0 {
        let mut live = alive.word(0);
        for key in keys {
            if live == 0 {
                return depths;
            }
            let kept = live & holders(key).low();
            depths.set_bits(0, live & !kept, depth);
            live = kept;
            depth += 1;
        }
        depths.set_bits(0, live, depth);
    } else {
        let mut live: Vec<Slot> = alive.iter().collect();
        // Keys are read eight at a time before any is tested: their probes (and the
        // records they point to) are independent loads the CPU overlaps, where one key at
        // a time waits out two cache misses per key (1,024 endpoints, 8 holders per
        // block: walk p99 13.8 us one at a time on this machine, see scale.md).
        let mut batch: Vec<H> = Vec::with_capacity(BATCH);
        loop {
            batch.clear();
            batch.extend(keys.by_ref().take(BATCH).map(&mut holders));
            if batch.is_empty() {
                break;
            }
            batch.iter().for_each(H::touch);
            for (i, held) in batch.iter().enumerate() {
                // Every live slot holds the key before (`retain` kept only those), so a key
                // with the same holders drops none.
                let before = i.checked_sub(1).and_then(|b| batch.get(b));
                if !before.is_some_and(|b| held.same_as(b)) {
                    held.retain(&mut live, |slot| depths.set(slot.index(), depth));
                    if live.is_empty() {
                        return depths;
                    }
                }
                depth += 1;
            }
        }
        live.iter().for_each(|s| depths.set(s.index(), depth));
    }
    depths
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(n: usize) -> Slot {
        Slot::new(n).unwrap()
    }

    #[test]
    fn holders_pack_in_the_first_form_that_fits_and_back() {
        let mut spill = Spill::default();
        let mut h = Holders::default();
        assert!(spill.insert(&mut h, slot(3)));
        assert!(!spill.insert(&mut h, slot(3)));
        assert!(spill.insert(&mut h, slot(62)));
        assert_eq!(h, Holders(1 << 3 | 1 << 62), "slots below 63 are a bitmask");
        assert!(spill.insert(&mut h, slot(1000)));
        assert_eq!(h.kind(), Kind::Inline);
        for n in [63, 64] {
            spill.insert(&mut h, slot(n));
        }
        assert_eq!(h.kind(), Kind::Inline, "five slots fit in the word");
        spill.insert(&mut h, slot(500));
        assert_eq!((h.kind(), spill.len()), (Kind::Record(0), 1));
        for n in [501, 502] {
            spill.insert(&mut h, slot(n));
        }
        assert_eq!(h.kind(), Kind::Record(0), "eight fit in a record");
        spill.insert(&mut h, slot(503));
        assert_eq!(
            (h.kind(), spill.len()),
            (Kind::Bitmap(0), 1),
            "the record is freed"
        );
        let mut set = SlotSet::default();
        spill.add_to(h, &mut set);
        let held: Vec<usize> = set.iter().map(Slot::index).collect();
        assert_eq!(held, [3, 62, 63, 64, 500, 501, 502, 503, 1000]);
        assert!(spill.contains(h, slot(500)) && !spill.contains(h, slot(504)));
        assert_eq!(spill.low_spilled(h), 1 << 3 | 1 << 62 | 1 << 63);
        for n in [500, 501, 502, 503] {
            assert!(spill.remove(&mut h, slot(n)));
        }
        assert!(!spill.remove(&mut h, slot(500)));
        assert_eq!(
            (h.kind(), spill.len()),
            (Kind::Inline, 0),
            "the bitmap is freed"
        );
        assert_eq!(spill.low_spilled(h), 1 << 3 | 1 << 62 | 1 << 63);
        for n in [63, 64, 1000] {
            spill.remove(&mut h, slot(n));
        }
        assert_eq!(h, Holders(1 << 3 | 1 << 62));
        spill.remove(&mut h, slot(3));
        spill.remove(&mut h, slot(62));
        assert!(h.is_empty());
    }

    #[test]
    fn spilled_records_and_bitmaps_are_reused() {
        let mut spill = Spill::default();
        let (mut a, mut b) = (Holders::default(), Holders::default());
        for n in 100..107 {
            spill.insert(&mut a, slot(n));
        }
        for n in 200..220 {
            spill.insert(&mut b, slot(n));
        }
        spill.release(a);
        spill.release(b);
        let (mut c, mut d) = (Holders::default(), Holders::default());
        for n in 300..307 {
            spill.insert(&mut c, slot(n));
        }
        for n in 400..420 {
            spill.insert(&mut d, slot(n));
        }
        assert_eq!((c.kind(), d.kind()), (Kind::Record(0), Kind::Bitmap(0)));
        assert_eq!(spill.len(), 2);
        assert!(spill.contains(c, slot(305)) && !spill.contains(c, slot(105)));
        assert!(spill.contains(d, slot(405)) && !spill.contains(d, slot(205)));
    }

    #[test]
    fn keys_with_the_same_holders_share_one_record_until_one_changes() {
        let mut spill = Spill::default();
        let mut keys = [Holders::default(); 3];
        for h in keys.iter_mut() {
            for n in [100, 200, 300, 400, 500, 600] {
                spill.insert(h, slot(n));
            }
        }
        assert_eq!(keys[0], keys[2], "one record");
        assert_eq!(spill.len(), 1);
        spill.insert(&mut keys[1], slot(700));
        assert_ne!(keys[1], keys[0]);
        assert!(
            !spill.contains(keys[0], slot(700)),
            "the others keep theirs"
        );
        assert!(spill.contains(keys[1], slot(700)));
        assert_eq!(spill.len(), 2);
        spill.remove(&mut keys[1], slot(700));
        assert_eq!(
            (keys[1], spill.len()),
            (keys[0], 1),
            "back to the shared one"
        );
        for h in keys {
            spill.release(h);
        }
        assert!(spill.is_empty());
    }

    #[test]
    fn slot_sets_find_their_first_gap() {
        let mut set: SlotSet = (0..70).filter_map(Slot::new).collect();
        assert_eq!(set.first_absent(), Some(slot(70)));
        set.remove(slot(5));
        assert_eq!(set.first_absent(), Some(slot(5)));
        let full: SlotSet = (0..MAX_SLOTS).filter_map(Slot::new).collect();
        assert_eq!((full.first_absent(), full.len()), (None, MAX_SLOTS));
        set.clear();
        assert!(set.is_empty());
    }

    #[test]
    fn walks_agree_with_a_naive_model_at_every_fleet_size() {
        let mut state = 11u64;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            state >> 33
        };
        // Low slots only (a small fleet), a few high ones (walked one by one), and many.
        let fleets: [Vec<usize>; 4] = [
            (0..8).collect(),
            vec![0, 5, 61, 62, 63, 64, 640, 1023],
            (0..40).map(|n| n * 25).collect(),
            (0..MAX_SLOTS).collect(),
        ];
        for fleet in fleets {
            let mut spill = Spill::default();
            let mut table: std::collections::HashMap<u64, Holders> = Default::default();
            let mut model: Vec<std::collections::HashSet<u64>> =
                vec![Default::default(); fleet.len()];
            for _ in 0..20_000 {
                let (i, key) = ((next() as usize) % fleet.len(), next() % 12);
                let h = table.entry(key).or_default();
                if next() % 3 == 0 {
                    assert_eq!(spill.remove(h, slot(fleet[i])), model[i].remove(&key));
                } else {
                    assert_eq!(spill.insert(h, slot(fleet[i])), model[i].insert(key));
                }
                let query: Vec<u64> = (0..(next() % 6)).map(|_| next() % 12).collect();
                let got = longest_prefixes_by(query.iter().copied(), |k| HolderView {
                    holders: table.get(&k).copied().unwrap_or_default(),
                    spill: &spill,
                });
                for (n, held) in fleet.iter().zip(&model) {
                    let want = query.iter().take_while(|k| held.contains(k)).count() as u32;
                    assert_eq!(got.get(*n), want, "fleet of {}, slot {n}", fleet.len());
                }
            }
            let live: std::collections::HashSet<Holders> = table
                .values()
                .filter(|h| matches!(h.kind(), Kind::Record(_) | Kind::Bitmap(_)))
                .copied()
                .collect();
            assert_eq!(spill.len(), live.len(), "nothing spilled leaks");
            for (place, (_, uses)) in spill.records.items.iter().enumerate() {
                let users = table
                    .values()
                    .filter(|h| h.kind() == Kind::Record(place))
                    .count();
                assert_eq!(*uses as usize, users, "record {place}'s count");
            }
        }
    }
}
