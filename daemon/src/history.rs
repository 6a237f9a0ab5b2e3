//! Where approximate keys were routed: the index approximate mode asks, in place of KV
//! events (which carry vLLM's keys, not text-derived ones). Like Gateway API Inference
//! Extension's approximate prefix scorer, it remembers the replicas earlier requests with
//! the same text prefix were sent to, least recently used first out.

use std::collections::VecDeque;

use kvaffine_core::approximate::TextKey;

use crate::huge::HugeMap;
use crate::slots::{Depths, HolderView, Holders, Slot, Spill, longest_prefixes_by};

struct Entry {
    holders: Holders,
    stamp: u64,
}

/// Text-prefix keys and the slots they were routed to, bounded to `capacity` keys.
pub struct History {
    entries: HugeMap<u64, Entry>,
    /// The holder sets too large to pack in an entry.
    spill: Spill,
    /// Keys in the order they were last touched; stale positions are skipped on eviction.
    order: VecDeque<(u64, u64)>,
    stamp: u64,
    capacity: usize,
}

impl History {
    /// An empty history of at most `capacity` keys.
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: HugeMap::default(),
            spill: Spill::default(),
            order: VecDeque::new(),
            stamp: 0,
            capacity: capacity.max(1),
        }
    }

    /// `slot` served a request with these keys.
    pub fn record(&mut self, slot: Slot, keys: &[TextKey]) {
        for &TextKey(key) in keys {
            self.stamp += 1;
            let entry = self.entries.entry(key).or_insert(Entry {
                holders: Holders::default(),
                stamp: 0,
            });
            self.spill.insert(&mut entry.holders, slot);
            entry.stamp = self.stamp;
            self.order.push_back((key, self.stamp));
        }
        while self.entries.len() > self.capacity || self.order.len() > 4 * self.capacity {
            let Some((key, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.entries.get(&key).is_some_and(|e| e.stamp == stamp) {
                if let Some(gone) = self.entries.remove(&key) {
                    self.spill.release(gone.holders);
                }
            }
        }
    }

    /// For every slot, how many leading `keys` were routed to it.
    pub fn longest_prefixes(&self, keys: &[TextKey]) -> Depths {
        longest_prefixes_by(keys.iter().map(|k| k.0), |key| HolderView {
            holders: self
                .entries
                .get(&key)
                .map(|e| e.holders)
                .unwrap_or_default(),
            spill: &self.spill,
        })
    }

    /// Forgets `slot` (its endpoint was removed).
    pub fn forget_slot(&mut self, slot: Slot) {
        let spill = &mut self.spill;
        self.entries.retain(|_, e| {
            spill.remove(&mut e.holders, slot);
            !e.holders.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_routed_prefixes_and_forgets_the_least_recent() {
        let (a, b) = (Slot::new(0).unwrap(), Slot::new(1).unwrap());
        let keys = |k: &[u64]| k.iter().copied().map(TextKey).collect::<Vec<_>>();
        let mut history = History::new(4);
        history.record(a, &keys(&[1, 2, 3]));
        history.record(b, &keys(&[1, 9]));
        let m = history.longest_prefixes(&keys(&[1, 2, 3]));
        assert_eq!((m.get(0), m.get(1)), (3, 1));
        // Touching 1 and 9 again, then a new key, evicts 2 (least recently touched).
        history.record(b, &keys(&[1, 9, 10]));
        assert_eq!(history.longest_prefixes(&keys(&[1, 2, 3])).get(0), 1);
        history.forget_slot(b);
        assert_eq!(history.longest_prefixes(&keys(&[1, 9])).get(1), 0);
    }
}
