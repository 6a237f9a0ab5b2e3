//! Which cached prefixes many requests want at once. A lookup whose longest match ends at
//! a prefix other lookups also ended at within the last [`WINDOW`] is ranked with that
//! prefix in [`Demand::Shared`]: a hot system prompt is then spread over more replicas
//! instead of queueing behind the few that hold it. A conversation's own history ends at
//! a key only its own turns reach, so it keeps its replica as before.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvaffine_core::Demand;

/// How far back lookups count.
pub const WINDOW: Duration = Duration::from_secs(1);

/// Other lookups ending at the same prefix within [`WINDOW`] that make it shared: a
/// conversation's turns come seconds apart, a hot prompt's requests many times a second.
pub const SHARED_AFTER: u32 = 2;

/// Prefixes remembered at most; past it the stale go, then all (a burst of distinct
/// prefixes is not in demand).
const MAX_PREFIXES: usize = 65_536;

/// Recent lookups by the key their longest match ended at.
#[derive(Debug, Default)]
pub struct RecentPrefixes {
    /// Key -> (when its window began, lookups in it).
    seen: HashMap<u64, (Instant, u32)>,
}

impl RecentPrefixes {
    /// How much the prefix ending at `key` is wanted now.
    pub fn demand(&self, key: u64, now: Instant) -> Demand {
        match self.seen.get(&key) {
            Some((since, count))
                if now.saturating_duration_since(*since) < WINDOW && *count >= SHARED_AFTER =>
            {
                Demand::Shared
            }
            _ => Demand::Own,
        }
    }

    /// A lookup's longest match ended at `key`.
    pub fn note(&mut self, key: u64, now: Instant) {
        if self.seen.len() >= MAX_PREFIXES && !self.seen.contains_key(&key) {
            self.seen
                .retain(|_, (since, _)| now.saturating_duration_since(*since) < WINDOW);
            if self.seen.len() >= MAX_PREFIXES {
                self.seen.clear();
            }
        }
        let entry = self.seen.entry(key).or_insert((now, 0));
        if now.saturating_duration_since(entry.0) >= WINDOW {
            *entry = (now, 0);
        }
        entry.1 += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_shared_once_others_ended_there_within_the_window() {
        let now = Instant::now();
        let mut recent = RecentPrefixes::default();
        assert_eq!(recent.demand(7, now), Demand::Own);
        recent.note(7, now);
        assert_eq!(recent.demand(7, now), Demand::Own, "one lookup is its own");
        recent.note(7, now + Duration::from_millis(300));
        assert_eq!(
            recent.demand(7, now + Duration::from_millis(400)),
            Demand::Shared
        );
        assert_eq!(recent.demand(8, now), Demand::Own);
        // A window later it counts afresh: a conversation's turns seconds apart stay its own.
        let later = now + WINDOW + Duration::from_millis(1);
        assert_eq!(recent.demand(7, later), Demand::Own);
        recent.note(7, later);
        assert_eq!(recent.demand(7, later), Demand::Own);
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
