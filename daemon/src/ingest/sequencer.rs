//! Sequence bookkeeping for one endpoint's event stream: which payloads to apply, in which
//! order, when to ask for a replay, and when the index can no longer be complete.
//!
//! Pure (no sockets, no clock): the ingest thread feeds it what arrives and carries out
//! the actions it returns, so every gap, replay and restart path is tested directly.

use std::collections::VecDeque;

/// Live batches held while a replay is in flight; past this the oldest are dropped and the
/// endpoint flagged incomplete rather than growing without bound.
pub const MAX_HELD: usize = 10_000;

/// What the ingest thread must do, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Decode and apply this payload.
    Apply {
        /// The batch's sequence number.
        seq: u64,
        /// The msgpack batch.
        payload: Vec<u8>,
    },
    /// Send a replay request from this seq.
    RequestReplay(u64),
    /// The replica restarted: forget everything it held.
    Purge,
    /// Some events are lost for good: the index for this endpoint is incomplete.
    Incomplete(String),
    /// The index was emptied and rebuilt by a replay from seq 0 that lost nothing: it
    /// holds all the replica published, whatever was lost before.
    Complete,
}

struct Replay {
    from: u64,
    /// The index was emptied for this replay (a restart, a re-keying), so one that loses
    /// nothing makes it whole.
    rebuilds: bool,
    /// Something was lost during it.
    lost: bool,
    held: VecDeque<(u64, Vec<u8>)>,
    saw_batch: bool,
    /// After a reconnect: the fingerprint the batch at `from` must have if the publisher is
    /// the same process (a restarted one may have reached the same seq with other batches).
    verify: Option<u64>,
}

/// The stream state of one endpoint.
pub struct Sequencer {
    has_replay: bool,
    next: Option<u64>,
    replay: Option<Replay>,
    /// Fingerprint of the last applied payload (seq `next - 1`).
    last_fingerprint: Option<u64>,
}

fn fingerprint(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

impl Sequencer {
    /// A stream not yet connected; `has_replay` says whether the replica has a replay socket.
    pub fn new(has_replay: bool) -> Self {
        Self {
            has_replay,
            next: None,
            replay: None,
            last_fingerprint: None,
        }
    }

    /// The seq expected next, once known.
    pub fn next_seq(&self) -> Option<u64> {
        self.next
    }

    fn start_replay(&mut self, from: u64, actions: &mut Vec<Action>) {
        let held = self.replay.take().map(|r| r.held).unwrap_or_default();
        self.replay = Some(Replay {
            from,
            rebuilds: false,
            lost: false,
            held,
            saw_batch: false,
            verify: None,
        });
        actions.push(Action::RequestReplay(from));
    }

    /// The live socket reconnected after a disconnect: the publisher may be the same
    /// process or a restarted one that reached the same seq. Replay the last applied
    /// batch to tell them apart, and catch up on what was missed meanwhile.
    pub fn on_reconnect(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if !self.has_replay {
            return actions;
        }
        match (self.next, self.last_fingerprint, &self.replay) {
            (Some(next), Some(fp), None) if next > 0 => {
                self.start_replay(next - 1, &mut actions);
                if let Some(replay) = &mut self.replay {
                    replay.verify = Some(fp);
                }
            }
            (next, _, _) => self.start_replay(next.unwrap_or(0), &mut actions),
        }
        actions
    }

    /// The publisher turned out to be a new process: forget it all and replay from 0.
    fn restarted(&mut self, actions: &mut Vec<Action>) {
        actions.push(Action::Purge);
        self.last_fingerprint = None;
        self.rebuild(actions);
    }

    /// Replays from 0 into an emptied index.
    fn rebuild(&mut self, actions: &mut Vec<Action>) {
        self.next = None;
        self.start_replay(0, actions);
        if let Some(replay) = &mut self.replay {
            replay.rebuilds = true;
        }
    }

    /// Everything applied so far was purged (the endpoint turned out to need re-keying):
    /// fetch the whole stream again.
    pub fn resync(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        self.next = None;
        if self.has_replay {
            self.rebuild(&mut actions);
        } else {
            actions.push(Action::Incomplete(
                "blocks published before re-keying began cannot be rebuilt without a replay endpoint"
                    .to_owned(),
            ));
        }
        actions
    }

    /// The sockets are connected: catch up on what was published before.
    pub fn on_connect(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.has_replay {
            self.start_replay(self.next.unwrap_or(0), &mut actions);
        }
        actions
    }

    /// A live batch arrived.
    pub fn on_live(&mut self, seq: u64, payload: Vec<u8>) -> Vec<Action> {
        let mut actions = Vec::new();
        if let Some(replay) = &mut self.replay {
            if replay.held.len() >= MAX_HELD {
                replay.held.pop_front();
                replay.lost = true;
                actions.push(Action::Incomplete(format!(
                    "more than {MAX_HELD} live batches arrived during a replay"
                )));
            }
            replay.held.push_back((seq, payload));
            return actions;
        }
        self.live(seq, payload, &mut actions);
        actions
    }

    fn live(&mut self, seq: u64, payload: Vec<u8>, actions: &mut Vec<Action>) {
        match self.next {
            None => {
                if seq != 0 {
                    actions.push(Action::Incomplete(format!(
                        "batches 0..{seq} were published before the daemon connected and there is no replay endpoint"
                    )));
                }
                self.apply(seq, payload, actions);
            }
            Some(next) if seq == next => self.apply(seq, payload, actions),
            Some(next) if seq > next => {
                if self.has_replay {
                    self.start_replay(next, actions);
                    if let Some(replay) = &mut self.replay {
                        replay.held.push_back((seq, payload));
                    }
                } else {
                    actions.push(Action::Incomplete(format!(
                        "batches {next}..{seq} were lost and there is no replay endpoint"
                    )));
                    self.apply(seq, payload, actions);
                }
            }
            Some(_) => {
                if self.has_replay {
                    self.restarted(actions);
                    if let Some(replay) = &mut self.replay {
                        replay.held.push_back((seq, payload));
                    }
                } else {
                    actions.push(Action::Purge);
                    self.next = None;
                    self.live(seq, payload, actions);
                }
            }
        }
    }

    fn apply(&mut self, seq: u64, payload: Vec<u8>, actions: &mut Vec<Action>) {
        self.next = Some(seq.saturating_add(1));
        self.last_fingerprint = Some(fingerprint(&payload));
        actions.push(Action::Apply { seq, payload });
    }

    /// A replayed batch arrived.
    pub fn on_replay_batch(&mut self, seq: u64, payload: Vec<u8>) -> Vec<Action> {
        let mut actions = Vec::new();
        let Some(replay) = &mut self.replay else {
            return actions;
        };
        let first = !replay.saw_batch;
        replay.saw_batch = true;
        if let (true, Some(expected)) = (first, replay.verify.take()) {
            if seq == replay.from && fingerprint(&payload) == expected {
                return actions;
            }
            self.restarted(&mut actions);
            return actions;
        }
        if first && seq > replay.from {
            replay.lost = true;
            actions.push(Action::Incomplete(format!(
                "the replica's replay buffer no longer holds batches {}..{seq}",
                replay.from
            )));
        }
        let next = self.next.unwrap_or(0);
        if self.next.is_some() && seq < next {
            return actions;
        }
        if !first && seq > next && self.next.is_some() {
            replay.lost = true;
            actions.push(Action::Incomplete(format!(
                "replay skipped batches {next}..{seq}"
            )));
        }
        self.apply(seq, payload, &mut actions);
        actions
    }

    /// The replay ended (`timed_out`: it never finished); release the held live batches.
    pub fn on_replay_end(&mut self, timed_out: bool) -> Vec<Action> {
        let mut actions = Vec::new();
        let Some(replay) = self.replay.take() else {
            return actions;
        };
        if replay.verify.is_some() && !timed_out {
            // The publisher no longer has the last batch we applied: a new process.
            self.replay = Some(replay);
            self.restarted(&mut actions);
            return actions;
        }
        if timed_out {
            actions.push(Action::Incomplete(
                "a replay did not finish in time".to_owned(),
            ));
        }
        if self.next.is_none() && !timed_out {
            // An empty reply from the start: nothing was published yet.
            self.next = Some(replay.from);
        }
        for (seq, payload) in replay.held {
            match self.next {
                Some(next) if seq < next => {}
                Some(next) if seq > next => {
                    actions.push(Action::Incomplete(format!(
                        "batches {next}..{seq} were neither replayed nor received live"
                    )));
                    self.apply(seq, payload, &mut actions);
                }
                _ => self.apply(seq, payload, &mut actions),
            }
        }
        let lost = replay.lost || actions.iter().any(|a| matches!(a, Action::Incomplete(_)));
        if replay.rebuilds && !lost {
            actions.push(Action::Complete);
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(actions: &[Action]) -> Vec<u64> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Apply { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect()
    }

    fn incomplete(actions: &[Action]) -> bool {
        actions.iter().any(|a| matches!(a, Action::Incomplete(_)))
    }

    #[test]
    fn first_connect_replays_from_zero_and_holds_live_batches() {
        let mut s = Sequencer::new(true);
        assert_eq!(s.on_connect(), vec![Action::RequestReplay(0)]);
        assert!(s.on_live(3, vec![3]).is_empty());
        let mut actions = s.on_replay_batch(0, vec![0]);
        actions.extend(s.on_replay_batch(1, vec![1]));
        actions.extend(s.on_replay_batch(2, vec![2]));
        actions.extend(s.on_replay_batch(3, vec![3]));
        actions.extend(s.on_replay_end(false));
        assert_eq!(applied(&actions), vec![0, 1, 2, 3]);
        assert!(!incomplete(&actions));
        assert_eq!(applied(&s.on_live(4, vec![])), vec![4]);
    }

    #[test]
    fn an_empty_first_replay_expects_seq_zero() {
        let mut s = Sequencer::new(true);
        s.on_connect();
        assert!(s.on_replay_end(false).is_empty());
        assert_eq!(s.next_seq(), Some(0));
        assert_eq!(applied(&s.on_live(0, vec![])), vec![0]);
    }

    #[test]
    fn a_live_gap_is_replayed_then_the_held_batch_applied() {
        let mut s = Sequencer::new(true);
        s.on_connect();
        s.on_replay_end(false);
        s.on_live(0, vec![]);
        let actions = s.on_live(3, vec![]);
        assert_eq!(actions, vec![Action::RequestReplay(1)]);
        let mut actions = s.on_replay_batch(1, vec![]);
        actions.extend(s.on_replay_batch(2, vec![]));
        actions.extend(s.on_replay_batch(3, vec![]));
        actions.extend(s.on_replay_end(false));
        assert_eq!(applied(&actions), vec![1, 2, 3]);
        assert!(!incomplete(&actions));
    }

    #[test]
    fn a_replay_that_cannot_cover_the_gap_flags_incomplete() {
        let mut s = Sequencer::new(true);
        s.on_connect();
        s.on_replay_end(false);
        s.on_live(0, vec![]);
        s.on_live(9, vec![]);
        let actions = s.on_replay_batch(5, vec![]);
        assert!(incomplete(&actions));
        assert_eq!(applied(&actions), vec![5]);
    }

    #[test]
    fn without_replay_gaps_flag_incomplete_and_keep_applying() {
        let mut s = Sequencer::new(false);
        assert!(s.on_connect().is_empty());
        let first = s.on_live(4, vec![]);
        assert!(incomplete(&first));
        assert_eq!(applied(&first), vec![4]);
        let gap = s.on_live(7, vec![]);
        assert!(incomplete(&gap));
        assert_eq!(applied(&gap), vec![7]);
    }

    #[test]
    fn a_rebuild_from_zero_that_loses_nothing_makes_an_incomplete_index_whole() {
        let mut s = Sequencer::new(true);
        s.on_connect();
        // The replica's buffer no longer held batches 0..5 when the daemon connected.
        let mut actions = s.on_replay_batch(5, vec![5]);
        actions.extend(s.on_replay_end(false));
        assert!(incomplete(&actions));
        assert!(!actions.contains(&Action::Complete));
        // It restarts: seq from 0, and its replay holds everything.
        let mut actions = s.on_live(0, vec![0]);
        assert_eq!(actions, vec![Action::Purge, Action::RequestReplay(0)]);
        actions.extend(s.on_replay_batch(0, vec![0]));
        actions.extend(s.on_replay_batch(1, vec![1]));
        actions.extend(s.on_replay_end(false));
        assert_eq!(applied(&actions), vec![0, 1]);
        assert_eq!(actions.last(), Some(&Action::Complete));
        // A rebuild whose replay has lost its first batches stays incomplete.
        let mut actions = s.resync();
        actions.extend(s.on_replay_batch(1, vec![1]));
        actions.extend(s.on_replay_end(false));
        assert!(incomplete(&actions));
        assert!(!actions.contains(&Action::Complete));
        // Nor does a replay that is not a rebuild (a live gap) claim the index is whole.
        let mut actions = s.on_live(3, vec![3]);
        actions.extend(s.on_replay_batch(2, vec![2]));
        actions.extend(s.on_replay_batch(3, vec![3]));
        actions.extend(s.on_replay_end(false));
        assert_eq!(applied(&actions), vec![2, 3]);
        assert!(!actions.contains(&Action::Complete));
    }

    #[test]
    fn a_seq_going_backwards_is_a_restart_purge_and_resync() {
        let mut s = Sequencer::new(true);
        s.on_connect();
        s.on_replay_end(false);
        s.on_live(0, vec![]);
        s.on_live(1, vec![]);
        let actions = s.on_live(0, vec![7]);
        assert_eq!(actions, vec![Action::Purge, Action::RequestReplay(0)]);
        let mut actions = s.on_replay_batch(0, vec![7]);
        actions.extend(s.on_replay_end(false));
        assert_eq!(applied(&actions), vec![0]);
        let mut plain = Sequencer::new(false);
        plain.on_live(0, vec![]);
        plain.on_live(1, vec![]);
        let actions = plain.on_live(0, vec![]);
        assert_eq!(actions[0], Action::Purge);
        assert_eq!(applied(&actions), vec![0]);
    }

    #[test]
    fn a_resync_replays_from_zero_and_keeps_held_batches() {
        let mut s = Sequencer::new(true);
        s.on_connect();
        s.on_live(2, vec![]);
        s.on_replay_batch(0, vec![]);
        assert_eq!(s.resync(), vec![Action::RequestReplay(0)]);
        let mut actions = s.on_replay_batch(0, vec![]);
        actions.extend(s.on_replay_batch(1, vec![]));
        actions.extend(s.on_replay_end(false));
        assert_eq!(applied(&actions), vec![0, 1, 2]);
    }

    #[test]
    fn a_reconnect_to_the_same_publisher_resumes_without_a_purge() {
        let mut s = Sequencer::new(true);
        s.on_connect();
        s.on_replay_end(false);
        s.on_live(0, vec![1]);
        s.on_live(1, vec![2]);
        assert_eq!(s.on_reconnect(), vec![Action::RequestReplay(1)]);
        let mut actions = s.on_replay_batch(1, vec![2]);
        actions.extend(s.on_replay_batch(2, vec![3]));
        actions.extend(s.on_replay_end(false));
        assert_eq!(applied(&actions), vec![2]);
        assert!(!actions.contains(&Action::Purge));
    }

    #[test]
    fn a_reconnect_to_a_restarted_publisher_at_the_same_seq_purges() {
        let mut s = Sequencer::new(true);
        s.on_connect();
        s.on_replay_end(false);
        s.on_live(0, vec![1]);
        s.on_live(1, vec![2]);
        s.on_reconnect();
        // The new process also has a batch 1, but not ours.
        let actions = s.on_replay_batch(1, vec![9]);
        assert_eq!(actions, vec![Action::Purge, Action::RequestReplay(0)]);
        let mut actions = s.on_replay_batch(0, vec![8]);
        actions.extend(s.on_replay_batch(1, vec![9]));
        actions.extend(s.on_replay_end(false));
        assert_eq!(applied(&actions), vec![0, 1]);
        // A new process with fewer batches than we applied has no batch 1 at all.
        let mut t = Sequencer::new(true);
        t.on_connect();
        t.on_replay_end(false);
        t.on_live(0, vec![1]);
        t.on_live(1, vec![2]);
        t.on_reconnect();
        assert_eq!(
            t.on_replay_end(false),
            vec![Action::Purge, Action::RequestReplay(0)]
        );
    }

    #[test]
    fn a_replay_timeout_flags_incomplete_and_releases_held_batches() {
        let mut s = Sequencer::new(true);
        s.on_connect();
        s.on_live(5, vec![]);
        let actions = s.on_replay_end(true);
        assert!(incomplete(&actions));
        assert_eq!(applied(&actions), vec![5]);
    }
}
