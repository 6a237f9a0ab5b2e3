//! Bookings: a lookup's pick, remembered until the replica's events confirm it, and the
//! prefill backlog those picks put on each replica.
//!
//! Without them, requests that share a fresh prefix and arrive before its KV events (a
//! sibling burst; events lag prefill) would each see no match and scatter. A booked prefix
//! counts as held by its replica until the replica stores the booked blocks or the booking
//! expires. Each pick also adds its prefill work to its replica's backlog, which drains at
//! the configured prefill speed: a replica prefills one batch after another, so work booked
//! together finishes one after another.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use foldhash::fast::RandomState;

use crate::index::{MAX_SLOTS, Slot};

struct Booking {
    slot: Slot,
    keys: Vec<u64>,
    expires: Instant,
}

/// Queued prefill of one replica, in uncached-token equivalents, as of `at`.
#[derive(Clone, Copy)]
struct Backlog {
    tokens: f64,
    at: Option<Instant>,
}

impl Backlog {
    fn at(&self, now: Instant, tokens_per_second: f64) -> f64 {
        let drained = self.at.map_or(0.0, |at| {
            now.saturating_duration_since(at).as_secs_f64() * tokens_per_second
        });
        (self.tokens - drained).max(0.0)
    }
}

/// Live bookings, indexed by key for lookups and by last key for confirmation.
pub struct Bookings {
    entries: HashMap<u64, Booking, RandomState>,
    next_id: u64,
    /// Key -> (slot, number of live bookings of that key on that slot).
    holders: HashMap<u64, Vec<(Slot, u32)>, RandomState>,
    /// (slot, last key) -> booking id.
    by_last_key: HashMap<(Slot, u64), u64, RandomState>,
    backlog: [Backlog; MAX_SLOTS],
    tokens_per_second: f64,
}

impl Bookings {
    /// No bookings; backlogs drain at `tokens_per_second`.
    pub fn new(tokens_per_second: f64) -> Self {
        Self {
            entries: HashMap::default(),
            next_id: 0,
            holders: HashMap::default(),
            by_last_key: HashMap::default(),
            backlog: [Backlog {
                tokens: 0.0,
                at: None,
            }; MAX_SLOTS],
            tokens_per_second,
        }
    }

    /// Books `keys` on `slot` until `now + ttl`; `work` is the prefill it adds.
    pub fn book(&mut self, slot: Slot, keys: &[u64], work: u64, now: Instant, ttl: Duration) {
        if let Some(backlog) = self.backlog.get_mut(slot.index()) {
            let left = backlog.at(now, self.tokens_per_second);
            *backlog = Backlog {
                tokens: left + work as f64,
                at: Some(now),
            };
        }
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

    /// Prefill still queued per slot at `now`, in uncached-token equivalents.
    pub fn pending_tokens(&self, now: Instant) -> [u64; MAX_SLOTS] {
        let mut out = [0u64; MAX_SLOTS];
        for (out, backlog) in out.iter_mut().zip(&self.backlog) {
            *out = backlog.at(now, self.tokens_per_second) as u64;
        }
        out
    }

    /// Forgets every booking and the backlog on `slot` (the endpoint was purged or removed).
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
        if let Some(backlog) = self.backlog.get_mut(slot.index()) {
            *backlog = Backlog {
                tokens: 0.0,
                at: None,
            };
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
        let mut bookings = Bookings::new(1000.0);
        bookings.book(a, &[1, 2, 3], 192, now, ttl);
        bookings.book(b, &[1, 2], 64, now, ttl);
        assert_eq!(bookings.holders(1), 0b1001);
        assert_eq!(bookings.holders(3), 0b0001);
        bookings.confirm(a, &[2]);
        assert_eq!(bookings.holders(3), 0b0001, "2 is not a's last key");
        bookings.confirm(a, &[3]);
        assert_eq!(bookings.holders(1), 0b1000);
        bookings.expire(now + ttl);
        assert!(bookings.is_empty());
        assert_eq!(bookings.holders(1), 0);
    }

    #[test]
    fn the_backlog_adds_up_and_drains_one_batch_after_another() {
        let a = Slot::new(0).unwrap();
        let now = Instant::now();
        let ttl = Duration::from_secs(2);
        let mut bookings = Bookings::new(1000.0);
        bookings.book(a, &[1], 300, now, ttl);
        bookings.book(a, &[2], 300, now, ttl);
        assert_eq!(bookings.pending_tokens(now)[0], 600);
        assert_eq!(
            bookings.pending_tokens(now + Duration::from_millis(400))[0],
            200
        );
        bookings.book(a, &[3], 100, now + Duration::from_millis(400), ttl);
        assert_eq!(
            bookings.pending_tokens(now + Duration::from_millis(400))[0],
            300
        );
        assert_eq!(bookings.pending_tokens(now + Duration::from_secs(2))[0], 0);
        bookings.forget_slot(a);
        assert_eq!(bookings.pending_tokens(now)[0], 0);
    }
}
