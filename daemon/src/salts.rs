//! Which salts each replica holds a first block of, from its KV events. vLLM keys a
//! request's `cache_salt` into block 0 only and publishes it in that block's extra keys,
//! so a salt no replica holds a first block of cannot match a cached prefix anywhere: the
//! filter may route such a request by load without tokenizing it.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use foldhash::fast::RandomState;

use crate::index::Slot;

/// First blocks tracked per daemon; past it a replica's further salts are unknowable, and
/// it counts as holding every salt (a probe then tokenizes, as without this index).
pub const MAX_SALTED_ROOTS: usize = 1 << 20;

/// The salts of the first blocks each slot holds.
#[derive(Debug, Default)]
pub struct SaltIndex {
    /// (slot, first block's key) -> the salt tags its extra keys carry, and the copies
    /// stored (one per group and tier).
    roots: HashMap<(u8, u64), (Vec<u64>, u32), RandomState>,
    /// Salt tag -> (slot, first blocks of it the slot holds), only slots holding some: a
    /// salt is on one replica or a few, and a count per possible slot would cost 256 bytes
    /// for each of what may be millions of salts.
    held: HashMap<u64, Vec<(u8, u32)>, RandomState>,
    /// Slots whose salts cannot be known: a first block published without extra keys
    /// (vLLM before 0.17) or past [`MAX_SALTED_ROOTS`].
    unknown: u64,
}

impl SaltIndex {
    /// `slot` stored the first block `root`, its extra keys carrying `tags` (every string
    /// but the LoRA name: a multimodal hash taken for a salt only costs a tokenizer call),
    /// or None when the event had no extra keys at all.
    pub fn stored(&mut self, slot: Slot, root: u64, tags: Option<Vec<u64>>) {
        let Some(tags) = tags else {
            self.unknown |= bit(slot);
            return;
        };
        if tags.is_empty() {
            return;
        }
        let n = slot.index() as u8;
        let full = self.roots.len() >= MAX_SALTED_ROOTS;
        match self.roots.entry((n, root)) {
            Entry::Occupied(mut entry) => entry.get_mut().1 += 1,
            Entry::Vacant(entry) => {
                if full {
                    self.unknown |= bit(slot);
                    return;
                }
                for &tag in &tags {
                    let counts = self.held.entry(tag).or_default();
                    match counts.iter_mut().find(|(s, _)| *s == n) {
                        Some((_, count)) => *count += 1,
                        None => counts.push((n, 1)),
                    }
                }
                entry.insert((tags, 1));
            }
        }
    }

    /// `slot` dropped one copy of the block `key` (any block: most are not first blocks).
    pub fn removed(&mut self, slot: Slot, key: u64) {
        let Entry::Occupied(mut entry) = self.roots.entry((slot.index() as u8, key)) else {
            return;
        };
        entry.get_mut().1 -= 1;
        if entry.get().1 > 0 {
            return;
        }
        let (tags, _) = entry.remove();
        for tag in tags {
            self.release(tag, slot.index() as u8);
        }
    }

    /// `slot` holds nothing any more (purged, cleared or removed).
    pub fn purge(&mut self, slot: Slot) {
        let n = slot.index() as u8;
        let mut released = Vec::new();
        self.roots.retain(|(s, _), (tags, _)| {
            if *s == n {
                released.append(tags);
            }
            *s != n
        });
        for tag in released {
            self.release(tag, n);
        }
        self.unknown &= !bit(slot);
    }

    fn release(&mut self, tag: u64, slot: u8) {
        if let Entry::Occupied(mut held) = self.held.entry(tag) {
            let counts = held.get_mut();
            if let Some(i) = counts.iter().position(|(s, _)| *s == slot) {
                if let Some((_, count)) = counts.get_mut(i) {
                    *count -= 1;
                    if *count == 0 {
                        counts.swap_remove(i);
                    }
                }
            }
            if counts.is_empty() {
                held.remove();
            }
        }
    }

    /// The slots that hold, or may hold, a first block of salt `tag`, as bits.
    pub fn holders(&self, tag: u64) -> u64 {
        let held = self.held.get(&tag).map_or(0, |counts| {
            counts.iter().fold(0, |bits, (slot, _)| bits | 1 << slot)
        });
        held | self.unknown
    }
}

fn bit(slot: Slot) -> u64 {
    1 << slot.index()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(n: usize) -> Slot {
        Slot::new(n).unwrap()
    }

    #[test]
    fn a_salt_is_held_while_a_first_block_of_it_is() {
        let mut salts = SaltIndex::default();
        let (a, b) = (slot(0), slot(3));
        salts.stored(a, 10, Some(vec![7]));
        // The same block in a second group: two copies.
        salts.stored(a, 10, Some(vec![7]));
        salts.stored(b, 11, Some(vec![7, 8]));
        salts.stored(b, 12, Some(Vec::new()));
        assert_eq!(salts.holders(7), 0b1001);
        assert_eq!(salts.holders(8), 0b1000);
        assert_eq!(salts.holders(9), 0);
        salts.removed(a, 10);
        assert_eq!(salts.holders(7), 0b1001);
        salts.removed(a, 10);
        salts.removed(a, 99);
        assert_eq!(salts.holders(7), 0b1000);
        salts.purge(b);
        assert_eq!(
            (salts.holders(7), salts.holders(8), salts.roots.len()),
            (0, 0, 0)
        );
        assert!(salts.held.is_empty());
    }

    #[test]
    fn a_replica_whose_salts_cannot_be_known_may_hold_any() {
        let mut salts = SaltIndex::default();
        salts.stored(slot(2), 10, None);
        assert_eq!(salts.holders(1), 0b100);
        salts.purge(slot(2));
        assert_eq!(salts.holders(1), 0);
    }
}
