//! Bookings: a precise lookup's pick, remembered until the replica's events confirm it.
//!
//! Without them, requests that share a fresh prefix and arrive before its KV events (a
//! sibling burst; events lag prefill) would each see no match and scatter. A booked prefix
//! counts as held by its replica until the replica stores the booked blocks or the booking
//! expires. The prefill work each pick queues is kept apart, in [`crate::backlog`].

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use foldhash::fast::RandomState;
use kvaffine_core::BlockKey;

use crate::huge::HugeMap;
use crate::slots::{HeldBy, Slot, SlotSet};

struct Booking {
    slot: Slot,
    keys: Vec<u64>,
    /// The keys of the sliding windows its request leaves cached, on a hybrid replica.
    windows: Vec<u64>,
}

/// Key -> (slot, number of live bookings of that key on that slot).
#[derive(Default)]
struct Counted(HugeMap<u64, Vec<(Slot, u32)>>);

impl Counted {
    fn add(&mut self, slot: Slot, key: u64) {
        let counts = self.0.entry(key).or_default();
        match counts.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, n)) => *n += 1,
            None => counts.push((slot, 1)),
        }
    }

    fn sub(&mut self, slot: Slot, key: u64) {
        if let Some(counts) = self.0.get_mut(&key) {
            for (s, n) in counts.iter_mut() {
                if *s == slot {
                    *n -= 1;
                }
            }
            counts.retain(|(_, n)| *n > 0);
            if counts.is_empty() {
                self.0.remove(&key);
            }
        }
    }

    fn get(&self, key: u64) -> BookedBy<'_> {
        BookedBy(self.0.get(&key).map_or(&[], Vec::as_slice))
    }

    fn holds(&self, key: u64, slot: Slot) -> bool {
        self.0
            .get(&key)
            .is_some_and(|counts| counts.iter().any(|(s, _)| *s == slot))
    }
}

/// The slots holding live bookings of one key, as a walk reads them.
pub struct BookedBy<'a>(&'a [(Slot, u32)]);

impl HeldBy for BookedBy<'_> {
    fn low(&self) -> u64 {
        self.0
            .iter()
            .filter(|(s, _)| s.index() < 64)
            .fold(0, |bits, (s, _)| bits | 1 << s.index())
    }

    fn contains(&self, slot: Slot) -> bool {
        self.0.iter().any(|(s, _)| *s == slot)
    }

    fn add_to(&self, set: &mut SlotSet) {
        for (slot, _) in self.0 {
            set.insert(*slot);
        }
    }
}

/// Where each salt that no replica's events show yet was sent: its next requests follow
/// until the booking expires (by then the replica's events show the salt, or it was never
/// prefilled).
#[derive(Default)]
pub struct SaltBookings {
    by_tag: HashMap<u64, (String, Instant), RandomState>,
}

impl SaltBookings {
    /// Salts booked at once; past it expired bookings are swept, and a new one is
    /// refused if none had expired.
    pub const MAX_SALTS: usize = 65_536;

    /// Books salt `tag` on `endpoint` at `now` until `until`; false if refused (full).
    pub fn book(&mut self, tag: u64, endpoint: &str, now: Instant, until: Instant) -> bool {
        if self.by_tag.len() >= Self::MAX_SALTS && !self.by_tag.contains_key(&tag) {
            self.by_tag.retain(|_, (_, expiry)| *expiry > now);
            if self.by_tag.len() >= Self::MAX_SALTS {
                return false;
            }
        }
        self.by_tag.insert(tag, (endpoint.to_owned(), until));
        true
    }

    /// The endpoint salt `tag` is booked on at `now`, if any.
    pub fn get(&self, tag: u64, now: Instant) -> Option<String> {
        self.by_tag
            .get(&tag)
            .filter(|(_, until)| *until > now)
            .map(|(endpoint, _)| endpoint.clone())
    }
}

/// Live bookings, indexed by key for lookups, by last key for confirmation and by expiry,
/// holding at most a bounded number of keys.
#[derive(Default)]
pub struct Bookings {
    /// Keys held by live bookings, and the most they may hold.
    keys: usize,
    max_keys: usize,
    entries: HashMap<u64, Booking, RandomState>,
    next_id: u64,
    /// Who has booked each key.
    holders: Counted,
    /// Who has booked each key as part of a sliding window.
    windows: Counted,
    /// (slot, last key) -> booking id.
    by_last_key: HashMap<(Slot, u64), u64, RandomState>,
    /// Soonest expiry first; ids already dropped are skipped when they come up.
    expiries: BinaryHeap<Reverse<(Instant, u64)>>,
}

impl Bookings {
    /// No bookings; at most `max_keys` keys booked at once.
    pub fn new(max_keys: usize) -> Self {
        Self {
            max_keys,
            ..Self::default()
        }
    }

    /// Books `keys` on `slot` until `expires`, and the keys at `windows` as the sliding
    /// windows the request leaves cached on a hybrid replica (empty elsewhere); false if
    /// that would pass the key bound (the pick then counts only once its events arrive).
    pub fn book(
        &mut self,
        slot: Slot,
        keys: &[BlockKey],
        windows: &[std::ops::Range<usize>],
        expires: Instant,
    ) -> bool {
        let Some(&BlockKey(last)) = keys.last() else {
            return true;
        };
        if let Some(old) = self.by_last_key.remove(&(slot, last)) {
            self.drop_booking(old);
        }
        if self.keys + keys.len() > self.max_keys {
            return false;
        }
        self.keys += keys.len();
        let id = self.next_id;
        self.next_id += 1;
        for &BlockKey(key) in keys {
            self.holders.add(slot, key);
        }
        let windows: Vec<u64> = windows
            .iter()
            .filter_map(|range| keys.get(range.clone()))
            .flatten()
            .map(|k| k.0)
            .collect();
        for &key in &windows {
            self.windows.add(slot, key);
        }
        self.by_last_key.insert((slot, last), id);
        self.expiries.push(Reverse((expires, id)));
        self.entries.insert(
            id,
            Booking {
                slot,
                keys: keys.iter().map(|k| k.0).collect(),
                windows,
            },
        );
        true
    }

    fn drop_booking(&mut self, id: u64) {
        let Some(booking) = self.entries.remove(&id) else {
            return;
        };
        self.keys -= booking.keys.len();
        if let Some(last) = booking.keys.last() {
            self.by_last_key.remove(&(booking.slot, *last));
        }
        for key in &booking.keys {
            self.holders.sub(booking.slot, *key);
        }
        for key in &booking.windows {
            self.windows.sub(booking.slot, *key);
        }
    }

    /// Whether a booking is past its expiry at `now` (cheap: lookups ask it under a read
    /// lock and take the write lock only when there is something to drop).
    pub fn has_expired(&self, now: Instant) -> bool {
        self.expiries
            .peek()
            .is_some_and(|Reverse((expires, _))| *expires <= now)
    }

    /// Drops bookings past their expiry, soonest first.
    pub fn expire(&mut self, now: Instant) {
        while let Some(&Reverse((expires, id))) = self.expiries.peek() {
            if expires > now {
                break;
            }
            self.expiries.pop();
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

    /// The slots holding a live booking of `key`.
    pub fn holders(&self, key: u64) -> BookedBy<'_> {
        self.holders.get(key)
    }

    /// Whether `slot` holds a live booking of `key` in a sliding window.
    pub fn window_holds(&self, key: u64, slot: Slot) -> bool {
        self.windows.holds(key, slot)
    }

    /// Keys held by live bookings (expired ones count until a lookup drops them).
    pub fn booked_keys(&self) -> usize {
        self.keys
    }

    /// Whether any booking is live (lookups skip the overlay otherwise).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
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
    use std::time::Duration;

    use super::*;

    fn keys(k: &[u64]) -> Vec<BlockKey> {
        k.iter().copied().map(BlockKey).collect()
    }

    /// The slots holding a booking of `key`, by number.
    fn held(bookings: &Bookings, key: u64) -> Vec<usize> {
        let mut set = SlotSet::default();
        bookings.holders(key).add_to(&mut set);
        set.iter().map(Slot::index).collect()
    }

    #[test]
    fn bookings_hold_until_confirmed_or_expired() {
        let (a, b) = (Slot::new(0).unwrap(), Slot::new(3).unwrap());
        let now = Instant::now();
        let ttl = Duration::from_secs(2);
        let mut bookings = Bookings::new(100);
        bookings.book(a, &keys(&[1, 2, 3]), &[], now + ttl);
        bookings.book(b, &keys(&[1, 2]), &[], now + ttl);
        assert_eq!(held(&bookings, 1), [0, 3]);
        assert_eq!(held(&bookings, 3), [0]);
        bookings.confirm(a, &[2]);
        assert_eq!(held(&bookings, 3), [0], "2 is not a's last key");
        bookings.confirm(a, &[3]);
        assert_eq!(held(&bookings, 1), [3]);
        assert!(!bookings.has_expired(now));
        assert!(bookings.has_expired(now + ttl));
        bookings.expire(now + ttl);
        assert!(bookings.is_empty() && !bookings.has_expired(now + ttl));
        assert!(held(&bookings, 1).is_empty());
    }

    #[test]
    fn a_booking_holds_its_windows_apart_until_it_goes() {
        let a = Slot::new(2).unwrap();
        let now = Instant::now();
        let mut bookings = Bookings::new(100);
        bookings.book(
            a,
            &keys(&[1, 2, 3, 4, 5]),
            &[1..2, 3..5, 4..9],
            now + Duration::from_secs(1),
        );
        assert_eq!(held(&bookings, 1), [2]);
        assert_eq!(
            [1, 2, 3, 4, 5].map(|k| bookings.window_holds(k, a)),
            [false, true, false, true, true],
            "a window past the keys books nothing"
        );
        bookings.confirm(a, &[5]);
        assert!(!bookings.window_holds(2, a));
    }

    #[test]
    fn a_rebooked_prefix_expires_with_its_newest_booking() {
        let a = Slot::new(0).unwrap();
        let now = Instant::now();
        let mut bookings = Bookings::new(100);
        bookings.book(a, &keys(&[1, 2]), &[], now + Duration::from_secs(1));
        bookings.book(a, &keys(&[1, 2]), &[], now + Duration::from_secs(3));
        bookings.expire(now + Duration::from_secs(2));
        assert_eq!(
            held(&bookings, 2),
            [0],
            "the second booking replaced the first"
        );
        bookings.expire(now + Duration::from_secs(3));
        assert!(bookings.is_empty());
    }

    #[test]
    fn bookings_hold_at_most_their_key_bound() {
        let a = Slot::new(0).unwrap();
        let now = Instant::now();
        let mut bookings = Bookings::new(5);
        assert!(bookings.book(a, &keys(&[1, 2, 3]), &[], now + Duration::from_secs(1)));
        assert!(!bookings.book(a, &keys(&[4, 5, 6]), &[], now + Duration::from_secs(1)));
        assert!(held(&bookings, 4).is_empty());
        // Rebooking the same prefix replaces it rather than adding to it.
        assert!(bookings.book(a, &keys(&[1, 2, 3]), &[], now + Duration::from_secs(2)));
        bookings.expire(now + Duration::from_secs(2));
        assert!(bookings.book(
            a,
            &keys(&[4, 5, 6, 7, 8]),
            &[],
            now + Duration::from_secs(3)
        ));
    }
}
