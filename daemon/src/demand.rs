//! Which cached prefixes many requests want at once. A booked lookup whose longest match
//! ends at a prefix two other booked lookups also ended at within the last [`WINDOW`] is
//! ranked with that prefix in [`Demand::Shared`]: a hot system prompt is then spread over
//! more replicas instead of queueing behind the few that hold it. A conversation's own
//! history ends at a key only its own turns reach, so it keeps its replica as before.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvaffine_core::Demand;

/// How far back lookups count.
pub const WINDOW: Duration = Duration::from_secs(1);

/// Prefixes remembered at most; past it the stale go, then all (a burst of distinct
/// prefixes is not in demand).
const MAX_PREFIXES: usize = 65_536;

/// Recent lookups by the key their longest match ended at.
#[derive(Debug, Default)]
pub struct RecentPrefixes {
    /// Key -> when the last two lookups ending there came (older, newer).
    seen: HashMap<u64, (Option<Instant>, Instant)>,
}

impl RecentPrefixes {
    /// How much the prefix ending at `key` is wanted now: shared when two other lookups
    /// ended there within the last [`WINDOW`] (a conversation's turns come seconds apart
    /// and end further on each time; a hot prompt's requests come many times a second).
    pub fn demand(&self, key: u64, now: Instant) -> Demand {
        match self.seen.get(&key) {
            Some((Some(older), _)) if now.saturating_duration_since(*older) < WINDOW => {
                Demand::Shared
            }
            _ => Demand::Own,
        }
    }

    /// A lookup's longest match ended at `key`.
    pub fn note(&mut self, key: u64, now: Instant) {
        if self.seen.len() >= MAX_PREFIXES && !self.seen.contains_key(&key) {
            self.seen
                .retain(|_, (_, newer)| now.saturating_duration_since(*newer) < WINDOW);
            if self.seen.len() >= MAX_PREFIXES {
                self.seen.clear();
            }
        }
        self.seen
            .entry(key)
            .and_modify(|(older, newer)| (*older, *newer) = (Some(*newer), now))
            .or_insert((None, now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_shared_while_two_others_ended_there_within_the_window() {
        let now = Instant::now();
        let ms = |n| now + Duration::from_millis(n);
        let mut recent = RecentPrefixes::default();
        assert_eq!(recent.demand(7, now), Demand::Own);
        recent.note(7, now);
        assert_eq!(recent.demand(7, now), Demand::Own, "one lookup is its own");
        recent.note(7, ms(900));
        assert_eq!(recent.demand(7, ms(950)), Demand::Shared);
        assert_eq!(recent.demand(8, ms(950)), Demand::Own);
        // The last second, not a fixed one: the first of the two has gone by 1,000 ms...
        assert_eq!(recent.demand(7, ms(1000)), Demand::Own);
        // ...and one more lookup makes two within it again.
        recent.note(7, ms(1000));
        assert_eq!(recent.demand(7, ms(1100)), Demand::Shared);
        // A conversation's turns seconds apart stay its own.
        recent.note(9, now);
        recent.note(9, ms(3000));
        assert_eq!(recent.demand(9, ms(3500)), Demand::Own);
    }

    #[test]
    fn distinct_prefixes_are_bounded() {
        let now = Instant::now();
        let mut recent = RecentPrefixes::default();
        for key in 0..(MAX_PREFIXES as u64 + 10) {
            recent.note(key, now);
        }
        assert!(recent.seen.len() <= MAX_PREFIXES);
    }
}
