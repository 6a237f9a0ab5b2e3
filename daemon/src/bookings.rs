//! Bookings: a lookup's pick, remembered until the replica's events confirm it.
//!
//! Without them, requests that share a fresh prefix and arrive before its KV events (a
//! sibling burst; events lag prefill) would each see no match and scatter. A booked
//! prefix counts as held by its replica, and its uncached tokens count as that replica's
//! pending prefill, until the replica stores the booked blocks or the booking expires.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use foldhash::fast::RandomState;

use crate::index::{MAX_SLOTS, Slot};

struct Booking {
    slot: Slot,
    keys: Vec<u64>,
    pending_tokens: u64,
    expires: Instant,
}

/// Live bookings, indexed by key for lookups and by last key for confirmation.
#[derive(Default)]
pub struct Bookings {
    entries: HashMap<u64, Booking, RandomState>,
    next_id: u64,
    /// Key -> (slot, number of live bookings of that key on that slot).
    holders: HashMap<u64, Vec<(Slot, u32)>, RandomState>,
    /// (slot, last key) -> booking id.
    by_last_key: HashMap<(Slot, u64), u64, RandomState>,
}

impl Bookings {
    /// Books `keys` on `slot` until `now + ttl`; `pending_tokens` is the prefill it adds.
    pub fn book(
        &mut self,
        slot: Slot,
        keys: &[u64],
        pending_tokens: u64,
        now: Instant,
        ttl: Duration,
    ) {
        let Some(&last) = keys.last() else {
            return;
        };
        if let Some(old) = self.by_last_key.remove(&(slot, last)) {
            self.drop_booking(old);
        }
        let id = self.next_id;
        self.next_id += 1;
        for key in keys {
            let counts = self.holders.entry(*key).or_default();
            match counts.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, n)) => *n += 1,
                None => counts.push((slot, 1)),
            }
        }
        self.by_last_key.insert((slot, last), id);
        self.entries.insert(
            id,
            Booking {
                slot,
                keys: keys.to_vec(),
                pending_tokens,
                expires: now + ttl,
            },
        );
    }

    fn drop_booking(&mut self, id: u64) {
        let Some(booking) = self.entries.remove(&id) else {
            return;
        };
        if let Some(last) = booking.keys.last() {
            self.by_last_key.remove(&(booking.slot, *last));
        }
        for key in &booking.keys {
            if let Some(counts) = self.holders.get_mut(key) {
                for (slot, n) in counts.iter_mut() {
                    if *slot == booking.slot {
                        *n -= 1;
                    }
                }
                counts.retain(|(_, n)| *n > 0);
                if counts.is_empty() {
                    self.holders.remove(key);
                }
            }
        }
    }

    /// Drops bookings past their expiry.
    pub fn expire(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, b)| b.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.drop_booking(id);
        }
    }

    /// The replica stored these keys: bookings on it that end in one of them are confirmed.
    pub fn confirm(&mut self, slot: Slot, stored: &[u64]) {
        if self.entries.is_empty() {
            return;
        }
        let confirmed: Vec<u64> = stored
            .iter()
            .filter_map(|key| self.by_last_key.get(&(slot, *key)).copied())
            .collect();
        for id in confirmed {
            self.drop_booking(id);
        }
    }

    /// Slots holding a live booking of `key`.
    pub fn holders(&self, key: u64) -> u64 {
        self.holders.get(&key).map_or(0, |counts| {
            counts
                .iter()
                .fold(0, |bits, (slot, _)| bits | 1 << slot.index())
        })
    }

    /// Whether any booking is live (lookups skip the overlay otherwise).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Pending prefill tokens per slot.
    pub fn pending_tokens(&self) -> [u64; MAX_SLOTS] {
        let mut out = [0u64; MAX_SLOTS];
        for booking in self.entries.values() {
            if let Some(t) = out.get_mut(booking.slot.index()) {
                *t += booking.pending_tokens;
            }
        }
        out
    }

    /// Forgets every booking on `slot` (the endpoint was purged or removed).
    pub fn forget_slot(&mut self, slot: Slot) {
        let ids: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, b)| b.slot == slot)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.drop_booking(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bookings_hold_until_confirmed_or_expired() {
        let (a, b) = (Slot::new(0).unwrap(), Slot::new(3).unwrap());
        let now = Instant::now();
        let ttl = Duration::from_secs(2);
        let mut bookings = Bookings::default();
        bookings.book(a, &[1, 2, 3], 192, now, ttl);
        bookings.book(b, &[1, 2], 64, now, ttl);
        assert_eq!(bookings.holders(1), 0b1001);
        assert_eq!(bookings.holders(3), 0b0001);
        assert_eq!(bookings.pending_tokens()[0], 192);
        bookings.confirm(a, &[2]);
        assert_eq!(bookings.holders(3), 0b0001, "2 is not a's last key");
        bookings.confirm(a, &[3]);
        assert_eq!(bookings.holders(1), 0b1000);
        assert_eq!(bookings.pending_tokens()[0], 0);
        bookings.expire(now + ttl);
        assert!(bookings.is_empty());
        assert_eq!(bookings.holders(1), 0);
    }
}
