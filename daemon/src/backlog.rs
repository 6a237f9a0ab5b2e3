//! Backlogs: the prefill each pick queues on its replica, drained at the replica's speed
//! (a replica prefills one batch after another, so work booked together finishes one after
//! another) and at once for a pick when the replica's events store its last block. The
//! same confirmations time the replica: while a pick waits for its last block the replica
//! is busy, so the work confirmed over a busy period is what it prefilled in that time,
//! known before any of its requests finishes (see [`Confirmed`]); and a pick still
//! awaited is work it has not finished, so its speed is capped before its first prefill
//! ends (see [`Overdue`]).
//!
//! Every lookup reads every replica's backlog, so reading one costs a few operations per
//! replica and per key of the request, never a walk of the queued picks: each queue keeps
//! the position (in tokens) at which each of its picks is done, so a backlog is its last
//! position less what has drained, and one map finds the picks ending in a given key. Built
//! as a set of every queued pick's last key on each lookup instead, booked lookups answered
//! 6 k/s once queues filled, 22 k/s this way, same machine and session
//! (`docs/benchmarks/daemon.md`).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use foldhash::fast::RandomState;
use kvaffine_core::BlockKey;

use crate::slots::Slot;

/// Picks remembered per replica; past it the oldest is forgotten into the next one (its
/// work drains with the next pick's; its confirmation still counts if it is awaited
/// for timing, else it is lost). Timed picks awaited per replica are bounded alike.
const MAX_QUEUED_PICKS: usize = 1024;

/// How long after it was queued a timed pick (see [`ConfirmedBy::LastBlock`]) is awaited
/// once the speed has drained it: a replica measured slower than it is drains its queue
/// late, one measured faster early, and only the events say when a pick was really
/// prefilled. One whose event never comes (its request failed before prefill, or its
/// events were lost) stops counting then, and the busy period starts again from the next
/// awaited pick.
const TIMED_FOR: Duration = Duration::from_secs(30);

/// What confirms a pick: the replica's events storing one of its keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfirmedBy {
    /// Nothing (a text-keyed pick): it drains at the replica's speed only.
    Nothing,
    /// This key, which may be stored before the pick's prefill ends (a salt's first
    /// block) or not at all (a block the replica holds already).
    Key(u64),
    /// Its last block, which the replica does not hold yet: stored when its prefill is
    /// done, so the time it took times the replica.
    LastBlock(u64),
}

impl ConfirmedBy {
    fn key(self) -> Option<u64> {
        match self {
            Self::Nothing => None,
            Self::Key(key) | Self::LastBlock(key) => Some(key),
        }
    }
}

/// Prefill a replica's events confirmed: `work` computed-token equivalents (a pick's own,
/// as the ranking counted it) in `seconds` during which some timed pick was awaited, so
/// the replica was busy. A lower bound on its speed, near it once the period holds a few
/// picks: the time also holds the hops before the replica schedules the first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Confirmed {
    /// Work confirmed in the busy period so far.
    pub work: f64,
    /// Seconds since the busy period began.
    pub seconds: f64,
}

/// Prefill a replica has not finished: `work` computed-token equivalents (what its busy
/// period confirmed, and its oldest awaited pick's own) not done in the `seconds` since
/// the period began. The replica works first in first out, so an upper bound on its speed
/// while that pick is awaited, falling as the wait goes on: a slow replica is known to be
/// slow before its first prefill ends (see [`Backlogs::overdue`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overdue {
    /// Work the replica has not finished.
    pub work: f64,
    /// Seconds since its busy period began.
    pub seconds: f64,
}

/// One pick in a replica's queue.
#[derive(Clone, Copy, Debug)]
struct QueuedPick {
    /// Numbered in queue order, so a pick is found by binary search.
    number: u64,
    /// What confirms it.
    confirmed_by: ConfirmedBy,
    /// The queue position at which it is prefilled: the work of the picks before it and
    /// its own.
    end: f64,
}

/// A timed pick still awaited.
#[derive(Clone, Copy, Debug)]
struct Awaited {
    number: u64,
    last_key: u64,
    work: f64,
    queued_at: Instant,
}

/// The timed picks of one replica, awaited until their last block is stored whether or not
/// the speed has drained them, and the busy period they make.
#[derive(Clone, Debug, Default)]
struct Timing {
    /// Oldest first, so numbers ascend.
    awaited: VecDeque<Awaited>,
    /// When the oldest awaited pick's period began: a pick queued while none was awaited.
    busy_since: Option<Instant>,
    /// Work confirmed since then.
    done: f64,
    /// Work of the period no event times: what the queue held ahead of its first pick,
    /// and the untimed picks queued since (a salt's, a text-keyed one). The replica may
    /// do any of it before the oldest awaited pick, so [`Overdue`] counts it all.
    untimed: f64,
}

impl Timing {
    fn holds(&self, number: u64) -> bool {
        self.awaited
            .binary_search_by_key(&number, |pick| pick.number)
            .is_ok()
    }

    /// Awaits a pick queued behind `ahead` tokens of work; returns the oldest if the bound
    /// pushed it out.
    fn push(&mut self, pick: Awaited, ahead: f64) -> Option<Awaited> {
        if self.awaited.is_empty() {
            self.busy_since = Some(pick.queued_at);
            self.done = 0.0;
            self.untimed = ahead;
        }
        self.awaited.push_back(pick);
        if self.awaited.len() > MAX_QUEUED_PICKS {
            return self.awaited.pop_front();
        }
        None
    }

    /// The picks numbered `done` (sorted) were prefilled by `now`.
    fn confirm(&mut self, done: &[u64], now: Instant) -> Option<Confirmed> {
        let before = self.done;
        self.awaited.retain(|pick| {
            let found = done.binary_search(&pick.number).is_ok();
            if found {
                self.done += pick.work;
            }
            !found
        });
        let since = self.busy_since?;
        let confirmed = (self.done > before).then(|| Confirmed {
            work: self.done,
            seconds: now.saturating_duration_since(since).as_secs_f64(),
        });
        if self.awaited.is_empty() {
            self.busy_since = None;
        }
        confirmed
    }

    /// An untimed pick of `work` queued: counted if a period is under way.
    fn queue_untimed(&mut self, work: f64) {
        if self.busy_since.is_some() {
            self.untimed += work;
        }
    }

    /// What the replica has not finished by `now`, while a timed pick is awaited.
    fn overdue(&self, now: Instant) -> Option<Overdue> {
        let since = self.busy_since?;
        let oldest = self.awaited.front()?;
        Some(Overdue {
            work: self.done + self.untimed + oldest.work,
            seconds: now.saturating_duration_since(since).as_secs_f64(),
        })
    }

    /// Stops awaiting picks queued [`TIMED_FOR`] before `now` that the queue no longer
    /// holds (numbered below `queued_from`); each goes to `gone`. A busy period that lost
    /// one starts again from the oldest pick still awaited: the time since the lost one
    /// was queued may hold idle time, and would make the replica look slower than it is.
    fn expire(&mut self, now: Instant, queued_from: u64, gone: &mut impl FnMut(&Awaited)) {
        let mut expired = false;
        while let Some(oldest) = self.awaited.front().filter(|pick| {
            pick.number < queued_from && now.saturating_duration_since(pick.queued_at) >= TIMED_FOR
        }) {
            gone(oldest);
            self.awaited.pop_front();
            expired = true;
        }
        if expired {
            // What was untimed stays counted: some of it may still be ahead.
            self.busy_since = self.awaited.front().map(|pick| pick.queued_at);
            self.done = 0.0;
        }
    }
}

/// Prefill queued on one replica by picks, first in first out.
#[derive(Clone, Debug, Default)]
struct PrefillQueue {
    picks: VecDeque<QueuedPick>,
    /// The position drained as of `at`; back to zero whenever the queue empties.
    drained: f64,
    at: Option<Instant>,
    next_number: u64,
    timing: Timing,
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

    fn holds(&self, number: u64) -> bool {
        self.picks
            .binary_search_by_key(&number, |pick| pick.number)
            .is_ok()
    }

    /// Drains what `tokens_per_second` prefilled since the last change, and stops awaiting
    /// timed picks past [`TIMED_FOR`]. `unindex` gets (key, number) of each pick no event
    /// can confirm any more: out of the queue and no longer awaited.
    fn settle(&mut self, now: Instant, tokens_per_second: f64, unindex: &mut impl FnMut(u64, u64)) {
        self.drained = self.position(now, tokens_per_second);
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
        while let Some(front) = self.picks.front().filter(|pick| pick.end <= self.drained) {
            if let Some(key) = front.confirmed_by.key() {
                if !self.timing.holds(front.number) {
                    unindex(key, front.number);
                }
            }
            self.picks.pop_front();
        }
        if self.picks.is_empty() {
            self.drained = 0.0;
        }
        let queued_from = self
            .picks
            .front()
            .map_or(self.next_number, |pick| pick.number);
        self.timing.expire(now, queued_from, &mut |pick| {
            unindex(pick.last_key, pick.number)
        });
    }

    /// Queues `work` tokens behind the rest at `now` (the queue settled first); returns
    /// the pick's number. `unindex` gets what the bounds push out, as for
    /// [`Self::settle`].
    fn push(
        &mut self,
        work: f64,
        confirmed_by: ConfirmedBy,
        now: Instant,
        unindex: &mut impl FnMut(u64, u64),
    ) -> u64 {
        let start = self.picks.back().map_or(self.drained, |last| last.end);
        let number = self.next_number;
        self.next_number += 1;
        self.picks.push_back(QueuedPick {
            number,
            confirmed_by,
            end: start + work,
        });
        if let ConfirmedBy::LastBlock(last_key) = confirmed_by {
            let awaited = Awaited {
                number,
                last_key,
                work,
                queued_at: now,
            };
            if let Some(oldest) = self.timing.push(awaited, start - self.drained) {
                if !self.holds(oldest.number) {
                    unindex(oldest.last_key, oldest.number);
                }
            }
        } else {
            self.timing.queue_untimed(work);
        }
        if self.picks.len() > MAX_QUEUED_PICKS {
            if let Some(oldest) = self.picks.pop_front() {
                if let Some(key) = oldest.confirmed_by.key() {
                    if !self.timing.holds(oldest.number) {
                        unindex(key, oldest.number);
                    }
                }
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
    /// Confirming key -> the picks it confirms, as (slot, pick number): those queued, and
    /// timed ones drained but still awaited.
    by_last_key: HashMap<u64, Vec<(Slot, u64)>, RandomState>,
}

/// Forgets `slot`'s pick `number`, confirmed by `key`, in `by_last_key`.
fn unindex(
    by_last_key: &mut HashMap<u64, Vec<(Slot, u64)>, RandomState>,
    slot: Slot,
    key: u64,
    number: u64,
) {
    if let Some(picks) = by_last_key.get_mut(&key) {
        picks.retain(|&entry| entry != (slot, number));
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
        queue.settle(now, rate, &mut |key, number| {
            unindex(by_last_key, slot, key, number)
        });
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

    /// A pick at `now` adds `work` to `slot`'s queue, done once `slot` stores the key of
    /// `confirmed_by`.
    pub fn add(&mut self, slot: Slot, work: u64, confirmed_by: ConfirmedBy, now: Instant) {
        self.grow(slot);
        self.settle(slot, now);
        // Two picks awaiting the same block there are both confirmed when it is stored,
        // which times one prefill: the second is not timed.
        let confirmed_by = match confirmed_by {
            ConfirmedBy::LastBlock(key)
                if self
                    .by_last_key
                    .get(&key)
                    .is_some_and(|picks| picks.iter().any(|&(s, _)| s == slot)) =>
            {
                ConfirmedBy::Key(key)
            }
            other => other,
        };
        let by_last_key = &mut self.by_last_key;
        let Some(queue) = self.queues.get_mut(slot.index()) else {
            return;
        };
        let number = queue.push(work as f64, confirmed_by, now, &mut |key, number| {
            unindex(by_last_key, slot, key, number)
        });
        if let Some(key) = confirmed_by.key() {
            by_last_key.entry(key).or_default().push((slot, number));
        }
    }

    /// `slot` stored these keys at `now`: the picks confirmed by one of them are done.
    /// Picks queued before them drain on: a pick's last block may be an early block of a
    /// longer prompt still being prefilled. Returns what the replica was timed at, if this
    /// confirmed a timed pick.
    pub fn confirm(&mut self, slot: Slot, stored: &[u64], now: Instant) -> Option<Confirmed> {
        if !self.settle(slot, now) || self.by_last_key.is_empty() {
            return None;
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
            return None;
        }
        done.sort_unstable();
        let queue = self.queues.get_mut(slot.index())?;
        queue.remove(&done);
        queue.timing.confirm(&done, now)
    }

    /// What `slot`'s replica has not finished by `now`, while one of its timed picks is
    /// awaited. The bound ignores what the replica may have started of later picks in the
    /// same steps (vLLM's chunked prefill fills a step's token budget with the next
    /// waiting prompts: its design, not measured here), so it can be low by up to one
    /// step's budget over the time.
    pub fn overdue(&self, slot: Slot, now: Instant) -> Option<Overdue> {
        self.queues.get(slot.index())?.timing.overdue(now)
    }

    /// Prefill still queued per slot (by slot number) at `now`, in computed-token equivalents, for a
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
                if let Some(key) = pick.confirmed_by.key() {
                    unindex(&mut self.by_last_key, slot, key, pick.number);
                }
            }
            for pick in &queue.timing.awaited {
                unindex(&mut self.by_last_key, slot, pick.last_key, pick.number);
            }
            *queue = PrefillQueue::default();
        }
    }

    /// Picks indexed by confirming key: those the queues hold with a key, and the timed
    /// ones awaited beyond them.
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
        backlogs.add(a, 300, ConfirmedBy::Key(1), now);
        backlogs.add(a, 300, ConfirmedBy::Key(2), now);
        backlogs.add(a, 300, ConfirmedBy::Nothing, now);
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
        backlogs.add(a, 0, ConfirmedBy::Nothing, now);
        assert_eq!(backlogs.pending_tokens(later, &[]), [300]);
        let drained = later + Duration::from_secs(1);
        assert_eq!(backlogs.pending_tokens(drained, &[]), [0]);
        backlogs.add(a, 50, ConfirmedBy::Key(3), drained);
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
            backlogs.add(a, 1, ConfirmedBy::Key(key), now);
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
        backlogs.add(a, 300, ConfirmedBy::Key(11), now);
        backlogs.add(a, 300, ConfirmedBy::Key(12), now);
        backlogs.add(b, 600, ConfirmedBy::Key(11), now);
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
            backlogs.add(a, work, ConfirmedBy::Key(key), now);
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
        backlogs.add(
            a,
            10,
            ConfirmedBy::Key(4),
            later + Duration::from_millis(250),
        );
        assert_eq!(
            backlogs.pending_tokens(later + Duration::from_millis(250), &[]),
            [60]
        );
        backlogs.add(
            a,
            10,
            ConfirmedBy::Key(5),
            later + Duration::from_millis(400),
        );
        assert_eq!(backlogs.indexed(), 1);
        assert_eq!(
            backlogs.pending_tokens(later + Duration::from_millis(400), &[]),
            [10]
        );
    }

    #[test]
    fn timed_picks_are_awaited_past_the_speeds_drain_and_time_the_replica() {
        let a = slot(0);
        let now = Instant::now();
        let at = |ms: u64| now + Duration::from_millis(ms);
        // The speed says 10,000 tokens/s; the replica does 2,000.
        let mut backlogs = Backlogs::new(10_000.0);
        backlogs.add(a, 1000, ConfirmedBy::LastBlock(1), now);
        backlogs.add(a, 1000, ConfirmedBy::LastBlock(2), now);
        backlogs.settle(a, at(200));
        assert_eq!(backlogs.pending_tokens(at(200), &[]), [0]);
        // Drained by the speed, still awaited: their events confirm them when they come.
        assert_eq!(backlogs.indexed(), 2);
        let first = backlogs.confirm(a, &[1], at(500));
        assert_eq!(
            first,
            Some(Confirmed {
                work: 1000.0,
                seconds: 0.5
            })
        );
        let second = backlogs.confirm(a, &[2], at(1000));
        assert_eq!(
            second,
            Some(Confirmed {
                work: 2000.0,
                seconds: 1.0
            })
        );
        assert_eq!(backlogs.indexed(), 0);
        // Nothing awaited between: the next pick starts a busy period of its own.
        backlogs.add(a, 600, ConfirmedBy::LastBlock(3), at(5000));
        let third = backlogs.confirm(a, &[3], at(5300));
        assert_eq!(third.map(|c| c.work), Some(600.0));
        assert!(
            third.is_some_and(|c| (c.seconds - 0.3).abs() < 1e-9),
            "{third:?}"
        );
        // Picks confirmed by a key that may come early (a salt's first block) or not at all
        // (a block held already) time nothing, and a key no pick awaits confirms nothing.
        backlogs.add(a, 600, ConfirmedBy::Key(4), at(6000));
        assert_eq!(backlogs.confirm(a, &[4], at(6100)), None);
        assert_eq!(backlogs.confirm(a, &[3], at(6100)), None);
    }

    #[test]
    fn an_awaited_pick_tells_what_the_replica_has_not_finished() {
        let a = slot(0);
        let now = Instant::now();
        let at = |ms: u64| now + Duration::from_millis(ms);
        let mut backlogs = Backlogs::new(10_000.0);
        assert_eq!(backlogs.overdue(a, now), None);
        // Nothing awaited: a pick confirmed by a key that may come early times nothing.
        backlogs.add(a, 3000, ConfirmedBy::Key(9), now);
        assert_eq!(backlogs.overdue(a, at(500)), None);
        // Queued behind 2,000 tokens of it (by the speed), and an untimed pick after it:
        // the replica may do both first, so both count.
        backlogs.add(a, 3000, ConfirmedBy::LastBlock(1), at(100));
        backlogs.add(a, 500, ConfirmedBy::Nothing, at(150));
        backlogs.add(a, 1000, ConfirmedBy::LastBlock(2), at(200));
        let overdue = |backlogs: &Backlogs, ms| backlogs.overdue(a, at(ms));
        assert_eq!(
            overdue(&backlogs, 1100),
            Some(Overdue {
                work: 5500.0,
                seconds: 1.0
            })
        );
        // Once it is confirmed, the next one: the first's work is done, the second's not.
        backlogs.confirm(a, &[1], at(1500));
        assert_eq!(
            overdue(&backlogs, 2100),
            Some(Overdue {
                work: 6500.0,
                seconds: 2.0
            })
        );
        backlogs.confirm(a, &[2], at(2200));
        assert_eq!(overdue(&backlogs, 2300), None);
        // A new period counts only what is ahead of it then.
        backlogs.add(a, 4000, ConfirmedBy::LastBlock(3), at(10_000));
        assert_eq!(
            overdue(&backlogs, 11_000),
            Some(Overdue {
                work: 4000.0,
                seconds: 1.0
            })
        );
    }

    #[test]
    fn a_timed_pick_whose_event_never_comes_stops_counting_once_drained_and_old() {
        let a = slot(0);
        let now = Instant::now();
        let mut backlogs = Backlogs::new(1000.0);
        backlogs.add(a, 100, ConfirmedBy::LastBlock(1), now);
        let expired = now + TIMED_FOR;
        backlogs.add(a, 100, ConfirmedBy::LastBlock(2), expired);
        // The first is forgotten: its key confirms nothing, and the busy period is the
        // second's alone.
        assert_eq!(backlogs.indexed(), 1);
        assert_eq!(backlogs.confirm(a, &[1], expired), None);
        let confirmed = backlogs.confirm(a, &[2], expired + Duration::from_millis(400));
        assert_eq!(confirmed.map(|c| c.work), Some(100.0));
        assert!(
            confirmed.is_some_and(|c| (c.seconds - 0.4).abs() < 1e-9),
            "{confirmed:?}"
        );
        // One the speed has not drained yet (a replica measured slow) is awaited as long
        // as it is queued.
        let mut slow = Backlogs::new(1.0);
        slow.add(a, 1000, ConfirmedBy::LastBlock(7), now);
        slow.add(a, 1, ConfirmedBy::Nothing, now + TIMED_FOR * 2);
        let late = slow.confirm(a, &[7], now + TIMED_FOR * 2);
        assert_eq!(late.map(|c| c.work), Some(1000.0));
        // Lost with later picks awaited behind it: the busy period starts again from the
        // oldest of them, not from the lost one (the replica may have idled since).
        let mut lossy = Backlogs::new(1000.0);
        lossy.add(a, 100, ConfirmedBy::LastBlock(1), now);
        let behind = now + Duration::from_secs(20);
        lossy.add(a, 100, ConfirmedBy::LastBlock(2), behind);
        lossy.settle(a, expired);
        assert_eq!(lossy.indexed(), 1);
        let confirmed = lossy.confirm(a, &[2], expired + Duration::from_millis(400));
        assert_eq!(confirmed.map(|c| c.work), Some(100.0));
        let seconds = (expired - behind).as_secs_f64() + 0.4;
        assert!(
            confirmed.is_some_and(|c| (c.seconds - seconds).abs() < 1e-6),
            "{confirmed:?}"
        );
    }

    #[test]
    fn two_picks_awaiting_one_block_time_one_prefill() {
        let a = slot(0);
        let now = Instant::now();
        let mut backlogs = Backlogs::new(1000.0);
        backlogs.add(a, 2000, ConfirmedBy::LastBlock(5), now);
        backlogs.add(a, 300, ConfirmedBy::LastBlock(5), now);
        let confirmed = backlogs.confirm(a, &[5], now + Duration::from_secs(1));
        assert_eq!(confirmed.map(|c| c.work), Some(2000.0));
        assert_eq!(backlogs.indexed(), 0);
        assert_eq!(
            backlogs.pending_tokens(now + Duration::from_secs(1), &[]),
            [0]
        );
    }

    #[test]
    fn timed_picks_are_awaited_within_the_bound() {
        let a = slot(0);
        let now = Instant::now();
        let picks = MAX_QUEUED_PICKS as u64 + 10;
        // Queued at once, both bounds overflow together.
        let mut backlogs = Backlogs::new(1e9);
        for key in 0..picks {
            backlogs.add(a, 1, ConfirmedBy::LastBlock(key), now);
        }
        assert_eq!(backlogs.indexed(), MAX_QUEUED_PICKS);
        assert_eq!(backlogs.confirm(a, &[0], now), None);
        backlogs.forget_slot(a);
        assert_eq!(backlogs.indexed(), 0);
        // Each drained before the next is queued: only the awaited bound holds them.
        let mut drained = Backlogs::new(1000.0);
        for key in 0..picks {
            drained.add(
                a,
                1,
                ConfirmedBy::LastBlock(key),
                now + Duration::from_millis(key),
            );
        }
        assert_eq!(drained.indexed(), MAX_QUEUED_PICKS);
        let last = now + Duration::from_millis(picks);
        assert_eq!(drained.confirm(a, &[9], last), None);
        let confirmed = drained.confirm(a, &[10], last);
        assert_eq!(confirmed.map(|c| c.work), Some(1.0));
    }
}
