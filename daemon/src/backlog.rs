//! Backlogs: the prefill each pick queues on its replica, drained at the replica's speed
//! (a replica prefills one batch after another, so work booked together finishes one after
//! another) and at once for a pick when the replica's events store its last block.
//!
//! Every lookup reads every replica's backlog, so reading one costs a few operations per
//! replica and per key of the request, never a walk of the queued picks: each queue keeps
//! the position (in tokens) at which each of its picks is done, so a backlog is its last
//! position less what has drained, and one map finds the picks ending in a given key. Built
//! as a set of every queued pick's last key on each lookup instead, booked lookups answered
//! 6 k/s once queues filled, 22 k/s this way, same machine and session
//! (`docs/benchmarks/daemon.md`).

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use foldhash::fast::RandomState;
use kvaffine_core::BlockKey;

use crate::slots::Slot;

/// Picks remembered per replica; past it the oldest is forgotten into the next one (its
/// own confirmation is then lost, and its work drains with the next pick's).
const MAX_QUEUED_PICKS: usize = 1024;

/// One pick in a replica's queue.
#[derive(Clone, Copy, Debug)]
struct QueuedPick {
    /// Numbered in queue order, so a pick is found by binary search.
    number: u64,
    /// The last block key it booked (None for a text-keyed pick, which no event confirms).
    last_key: Option<u64>,
    /// The queue position at which it is prefilled: the work of the picks before it and
    /// its own.
    end: f64,
}

/// Prefill queued on one replica by picks, first in first out.
#[derive(Clone, Debug, Default)]
struct PrefillQueue {
    picks: VecDeque<QueuedPick>,
    /// The position drained as of `at`; back to zero whenever the queue empties.
    drained: f64,
    at: Option<Instant>,
    next_number: u64,
}

impl PrefillQueue {
    /// The position drained by `now` at `tokens_per_second` (no further than `at` if `now`
    /// is older: a lookup's clock may be older than a confirmation's).
    fn position(&self, now: Instant, tokens_per_second: f64) -> f64 {
        self.drained
            + self.at.map_or(0.0, |at| {
                now.saturating_duration_since(at).as_secs_f64() * tokens_per_second
            })
    }

    /// Drains what `tokens_per_second` prefilled since the last change; each pick drained
    /// whole goes to `gone`.
    fn settle(&mut self, now: Instant, tokens_per_second: f64, gone: &mut impl FnMut(&QueuedPick)) {
        self.drained = self.position(now, tokens_per_second);
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
        while let Some(front) = self.picks.front().filter(|pick| pick.end <= self.drained) {
            gone(front);
            self.picks.pop_front();
        }
        if self.picks.is_empty() {
            self.drained = 0.0;
        }
    }

    /// Queues `work` tokens behind the rest (the queue settled first); returns the pick's
    /// number. A pick pushed out by the bound goes to `gone`.
    fn push(
        &mut self,
        work: f64,
        last_key: Option<u64>,
        gone: &mut impl FnMut(&QueuedPick),
    ) -> u64 {
        let start = self.picks.back().map_or(self.drained, |last| last.end);
        let number = self.next_number;
        self.next_number += 1;
        self.picks.push_back(QueuedPick {
            number,
            last_key,
            end: start + work,
        });
        if self.picks.len() > MAX_QUEUED_PICKS {
            if let Some(oldest) = self.picks.pop_front() {
                gone(&oldest);
            }
        }
        number
    }

    /// Drops the picks numbered `done` (sorted; the queue settled first), prefilled as
    /// the replica's events say: the picks behind each move up by its work.
    fn remove(&mut self, done: &[u64]) {
        let mut shift = 0.0;
        let mut previous_end = self.drained;
        self.picks.retain_mut(|pick| {
            let work = pick.end - previous_end;
            previous_end = pick.end;
            if done.binary_search(&pick.number).is_ok() {
                shift += work;
                false
            } else {
                pick.end -= shift;
                true
            }
        });
        if self.picks.is_empty() {
            self.drained = 0.0;
        }
    }

    /// Tokens still queued at `now`.
    fn pending(&self, now: Instant, tokens_per_second: f64) -> f64 {
        self.picks.back().map_or(0.0, |last| {
            (last.end - self.position(now, tokens_per_second)).max(0.0)
        })
    }

    /// Tokens of pick `number` still queued at `now` (none once it is gone).
    fn left(&self, number: u64, now: Instant, tokens_per_second: f64) -> f64 {
        let Ok(i) = self.picks.binary_search_by_key(&number, |pick| pick.number) else {
            return 0.0;
        };
        let position = self.position(now, tokens_per_second);
        let start = i
            .checked_sub(1)
            .and_then(|before| self.picks.get(before))
            .map_or(position, |before| before.end.max(position));
        self.picks
            .get(i)
            .map_or(0.0, |pick| (pick.end - start).max(0.0))
    }
}

/// The prefill queued on each replica by picks: it drains at the replica's speed, and a
/// pick is done at once when the replica's events store its last block.
pub struct Backlogs {
    /// Per slot, grown to the highest slot used.
    queues: Vec<PrefillQueue>,
    tokens_per_second: Vec<f64>,
    /// The speed of a slot not yet told its own.
    unmeasured: f64,
    /// Last key -> the queued picks ending in it, as (slot, pick number).
    by_last_key: HashMap<u64, Vec<(Slot, u64)>, RandomState>,
}

/// Forgets `slot`'s pick in `by_last_key`.
fn unindex(
    by_last_key: &mut HashMap<u64, Vec<(Slot, u64)>, RandomState>,
    slot: Slot,
    pick: &QueuedPick,
) {
    let Some(key) = pick.last_key else {
        return;
    };
    if let Some(picks) = by_last_key.get_mut(&key) {
        picks.retain(|&entry| entry != (slot, pick.number));
        if picks.is_empty() {
            by_last_key.remove(&key);
        }
    }
}

impl Backlogs {
    /// Empty queues, every replica prefilling at `tokens_per_second` until told otherwise.
    pub fn new(tokens_per_second: f64) -> Self {
        Self {
            queues: Vec::new(),
            tokens_per_second: Vec::new(),
            unmeasured: tokens_per_second,
            by_last_key: HashMap::default(),
        }
    }

    /// Makes room for `slot`'s queue and speed.
    fn grow(&mut self, slot: Slot) {
        let n = slot.index() + 1;
        if self.queues.len() < n {
            self.queues.resize(n, PrefillQueue::default());
            self.tokens_per_second.resize(n, self.unmeasured);
        }
    }

    /// Settles `slot`'s queue at `now`; false if `slot` has no queue.
    fn settle(&mut self, slot: Slot, now: Instant) -> bool {
        let by_last_key = &mut self.by_last_key;
        let (Some(queue), Some(&rate)) = (
            self.queues.get_mut(slot.index()),
            self.tokens_per_second.get(slot.index()),
        ) else {
            return false;
        };
        queue.settle(now, rate, &mut |pick| unindex(by_last_key, slot, pick));
        true
    }

    /// `slot`'s replica prefills at `tokens_per_second` from `now` on (what it queued
    /// drained at the old speed until then).
    pub fn set_speed(&mut self, slot: Slot, tokens_per_second: f64, now: Instant) {
        self.grow(slot);
        if self.tokens_per_second.get(slot.index()) != Some(&tokens_per_second) {
            self.settle(slot, now);
            if let Some(rate) = self.tokens_per_second.get_mut(slot.index()) {
                *rate = tokens_per_second;
            }
        }
    }

    /// A pick at `now` adds `work` to `slot`'s queue, done once `slot` stores `last_key`.
    pub fn add(&mut self, slot: Slot, work: u64, last_key: Option<u64>, now: Instant) {
        self.grow(slot);
        self.settle(slot, now);
        let by_last_key = &mut self.by_last_key;
        let Some(queue) = self.queues.get_mut(slot.index()) else {
            return;
        };
        let number = queue.push(work as f64, last_key, &mut |pick| {
            unindex(by_last_key, slot, pick)
        });
        if let Some(key) = last_key {
            by_last_key.entry(key).or_default().push((slot, number));
        }
    }

    /// `slot` stored these keys: the picks ending in one of them are done. Picks queued
    /// before them drain on: a pick's last block may be an early block of a longer prompt
    /// still being prefilled.
    pub fn confirm(&mut self, slot: Slot, stored: &[u64], now: Instant) {
        if !self.settle(slot, now) || self.by_last_key.is_empty() {
            return;
        }
        let mut done = Vec::new();
        for key in stored {
            let Some(picks) = self.by_last_key.get_mut(key) else {
                continue;
            };
            picks.retain(|&(s, number)| {
                let here = s == slot;
                if here {
                    done.push(number);
                }
                !here
            });
            if picks.is_empty() {
                self.by_last_key.remove(key);
            }
        }
        if done.is_empty() {
            return;
        }
        done.sort_unstable();
        if let Some(queue) = self.queues.get_mut(slot.index()) {
            queue.remove(&done);
        }
    }

    /// Prefill still queued per slot (by slot number) at `now`, in uncached-token equivalents, for a
    /// request of block keys `own`. Picks whose last block is one of `own` are left out:
    /// they prefill a prefix of this request, work it needs wherever it goes (queued
    /// already on their replica, done again anywhere else), so they must not push it off
    /// that replica. Counted, a turn 1 whose events had not arrived yet sent its
    /// continuation to a cold replica whenever recomputing it looked a hair cheaper than
    /// waiting for turn 1 plus reading its cache.
    pub fn pending_tokens(&self, now: Instant, own: &[BlockKey]) -> Vec<u64> {
        let mut pending: Vec<f64> = self
            .queues
            .iter()
            .zip(&self.tokens_per_second)
            .map(|(queue, &rate)| queue.pending(now, rate))
            .collect();
        if !self.by_last_key.is_empty() {
            let mut own_picks: Vec<(Slot, u64)> = own
                .iter()
                .filter_map(|key| self.by_last_key.get(&key.0))
                .flatten()
                .copied()
                .collect();
            own_picks.sort_unstable();
            own_picks.dedup();
            for (slot, number) in own_picks {
                let n = slot.index();
                if let (Some(queue), Some(&rate), Some(tokens)) = (
                    self.queues.get(n),
                    self.tokens_per_second.get(n),
                    pending.get_mut(n),
                ) {
                    *tokens -= queue.left(number, now, rate);
                }
            }
        }
        // Rounded: a backlog less its own picks' work may come out a hair off a whole token.
        pending
            .into_iter()
            .map(|tokens| tokens.max(0.0).round() as u64)
            .collect()
    }

    /// Empties `slot`'s queue (the endpoint was purged or removed).
    pub fn forget_slot(&mut self, slot: Slot) {
        if let Some(queue) = self.queues.get_mut(slot.index()) {
            for pick in &queue.picks {
                unindex(&mut self.by_last_key, slot, pick);
            }
            *queue = PrefillQueue::default();
        }
    }

    /// Picks indexed by last key, in all queues: as many as the queues hold with a key.
    #[cfg(test)]
    fn indexed(&self) -> usize {
        self.by_last_key.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn keys(k: &[u64]) -> Vec<BlockKey> {
        k.iter().copied().map(BlockKey).collect()
    }

    fn slot(n: usize) -> Slot {
        Slot::new(n).unwrap()
    }

    #[test]
    fn the_queue_drains_oldest_first_and_events_confirm_picks_at_once() {
        let a = slot(0);
        let now = Instant::now();
        let mut backlogs = Backlogs::new(1000.0);
        backlogs.add(a, 300, Some(1), now);
        backlogs.add(a, 300, Some(2), now);
        backlogs.add(a, 300, None, now);
        assert_eq!(backlogs.pending_tokens(now, &[]), [900]);
        let later = now + Duration::from_millis(100);
        assert_eq!(backlogs.pending_tokens(later, &[]), [800]);
        // The replica stored the second pick's last block: it is done, however slowly the
        // estimate drained it; the first drains on (its last block may still be coming).
        backlogs.confirm(a, &[7, 2], later);
        assert_eq!(backlogs.pending_tokens(later, &[]), [500]);
        // A key no queued pick ends in confirms nothing.
        backlogs.confirm(a, &[9], later);
        assert_eq!(backlogs.pending_tokens(later, &[]), [500]);
        backlogs.confirm(a, &[1], later);
        assert_eq!(backlogs.pending_tokens(later, &[]), [300]);
        // A lookup's clock older than the last change drains nothing twice.
        assert_eq!(backlogs.pending_tokens(now, &[]), [300]);
        backlogs.add(a, 0, None, now);
        assert_eq!(backlogs.pending_tokens(later, &[]), [300]);
        let drained = later + Duration::from_secs(1);
        assert_eq!(backlogs.pending_tokens(drained, &[]), [0]);
        backlogs.add(a, 50, Some(3), drained);
        assert_eq!(backlogs.pending_tokens(drained, &[]), [50]);
        assert_eq!(backlogs.indexed(), 1);
    }

    #[test]
    fn the_queue_remembers_a_bounded_number_of_picks() {
        let a = slot(0);
        let now = Instant::now();
        let mut backlogs = Backlogs::new(1.0);
        let picks = MAX_QUEUED_PICKS as u64 + 10;
        for key in 0..picks {
            backlogs.add(a, 1, Some(key), now);
        }
        assert_eq!(backlogs.indexed(), MAX_QUEUED_PICKS);
        assert_eq!(backlogs.pending_tokens(now, &[]), [picks]);
        // The forgotten picks' work drains with the oldest remembered one, whose own
        // confirmation still counts; a forgotten pick's key confirms nothing.
        backlogs.confirm(a, &[0, picks - 1], now);
        assert_eq!(backlogs.pending_tokens(now, &[]), [picks - 1]);
        backlogs.confirm(a, &[10], now);
        assert_eq!(backlogs.pending_tokens(now, &[]), [picks - 12]);
        assert_eq!(backlogs.indexed(), MAX_QUEUED_PICKS - 2);
    }

    #[test]
    fn backlogs_drain_at_each_slots_speed_and_on_its_events() {
        let (a, b) = (slot(0), slot(1));
        let now = Instant::now();
        let mut backlogs = Backlogs::new(1000.0);
        backlogs.set_speed(b, 2000.0, now);
        backlogs.add(a, 300, Some(11), now);
        backlogs.add(a, 300, Some(12), now);
        backlogs.add(b, 600, Some(11), now);
        let later = now + Duration::from_millis(200);
        assert_eq!(backlogs.pending_tokens(later, &[]), [400, 200]);
        // A request whose prefix A's second pick prefills does not wait for that pick
        // there; A's first pick (100 left) and B's are still in front of it.
        assert_eq!(backlogs.pending_tokens(later, &keys(&[10, 12])), [100, 200]);
        assert_eq!(backlogs.pending_tokens(later, &keys(&[11, 12])), [0, 0]);
        // A key twice in a request leaves its pick out once.
        assert_eq!(backlogs.pending_tokens(later, &keys(&[12, 12])), [100, 200]);
        // A's first pick is stored: done, whatever the speed said. B stored nothing.
        backlogs.confirm(a, &[11], later);
        assert_eq!(backlogs.pending_tokens(later, &[]), [300, 200]);
        assert_eq!(backlogs.pending_tokens(later, &keys(&[12])), [0, 200]);
        // A speed learned later drains what is left at the new rate from then on.
        backlogs.set_speed(a, 100.0, later);
        assert_eq!(
            backlogs.pending_tokens(later + Duration::from_secs(1), &[]),
            [200, 0]
        );
        backlogs.forget_slot(a);
        assert_eq!(backlogs.pending_tokens(later, &[])[0], 0);
        assert_eq!(backlogs.indexed(), 1);
    }

    #[test]
    fn a_confirmed_pick_moves_the_picks_behind_it_up_and_drained_picks_leave_the_index() {
        let a = slot(0);
        let now = Instant::now();
        let mut backlogs = Backlogs::new(1000.0);
        for (work, key) in [(100, 1), (200, 2), (300, 3)] {
            backlogs.add(a, work, Some(key), now);
        }
        let later = now + Duration::from_millis(150);
        // 150 drained: the first pick is gone by the speed, the second half done.
        assert_eq!(backlogs.pending_tokens(later, &keys(&[1])), [450]);
        assert_eq!(backlogs.pending_tokens(later, &keys(&[2])), [300]);
        backlogs.confirm(a, &[2], later);
        // The third now drains right behind the drained position.
        assert_eq!(backlogs.pending_tokens(later, &[]), [300]);
        assert_eq!(backlogs.pending_tokens(later, &keys(&[3])), [0]);
        assert_eq!(backlogs.indexed(), 1);
        backlogs.add(a, 10, Some(4), later + Duration::from_millis(250));
        assert_eq!(
            backlogs.pending_tokens(later + Duration::from_millis(250), &[]),
            [60]
        );
        backlogs.add(a, 10, Some(5), later + Duration::from_millis(400));
        assert_eq!(backlogs.indexed(), 1);
        assert_eq!(
            backlogs.pending_tokens(later + Duration::from_millis(400), &[]),
            [10]
        );
    }
}
