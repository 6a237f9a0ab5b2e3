//! Choosing a replica: the longest cached prefix wins, until that replica is saturated.
//!
//! The policy ("sticky until saturated") and its knobs are documented in
//! `docs/daemon.md`. It is a pure function of the candidates, so the daemon, the
//! benchmarks and the tests all rank identically.

/// What is known of a replica's load, from its `/metrics` and from recent picks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc`, a fraction 0-1.
    pub kv_cache_usage: f64,
    /// Prompt tokens routed to the replica recently that it has not reported cached yet:
    /// prefill work it has queued or in flight.
    pub pending_prefill_tokens: u64,
}

/// One replica as the ranking sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Candidate {
    /// Leading request blocks the replica holds (or has booked).
    pub matched_blocks: usize,
    /// Its load.
    pub load: Load,
    /// False when the replica cannot take traffic by kvaffine's knowledge (misconfigured
    /// for the keys, or its metrics unreachable): ranked after every usable one.
    pub usable: bool,
}

/// The knobs of the ranking.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PickPolicy {
    /// A replica with this many waiting requests is saturated.
    pub max_waiting: u32,
    /// A replica with this much pending prefill is saturated.
    pub max_pending_prefill_tokens: u64,
    /// Matches shorter than this count as no match, so a short prefix every replica shares
    /// (a system prompt) does not pull traffic onto one replica.
    pub min_matched_blocks: usize,
}

impl Default for PickPolicy {
    fn default() -> Self {
        Self {
            max_waiting: 8,
            max_pending_prefill_tokens: 64 * 1024,
            min_matched_blocks: 1,
        }
    }
}

/// Why the first-ranked replica is first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PickReason {
    /// It holds the longest prefix and is not saturated.
    Prefix,
    /// No usable replica holds a prefix worth following: least loaded first.
    Load,
    /// A replica with a longer prefix was saturated: affinity yielded to load.
    Saturated,
    /// There is nothing to rank.
    NoCandidates,
}

impl PickReason {
    /// The value of the `x-kvaffine-reason` header and the daemon's `reason` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefix => "prefix",
            Self::Load => "load",
            Self::Saturated => "saturated",
            Self::NoCandidates => "no-candidates",
        }
    }
}

impl PickPolicy {
    fn saturated(&self, load: &Load) -> bool {
        load.waiting >= self.max_waiting
            || load.pending_prefill_tokens >= self.max_pending_prefill_tokens
    }

    fn useful_match(&self, matched: usize) -> usize {
        if matched >= self.min_matched_blocks {
            matched
        } else {
            0
        }
    }

    /// Candidate indices, best first, and why the first is first.
    ///
    /// Order: usable before unusable; unsaturated before saturated; longer useful prefix
    /// first; then less waiting, less pending prefill, fewer running, lower KV usage;
    /// then input order (stable), so equal replicas keep a deterministic order.
    pub fn rank(&self, candidates: &[Candidate]) -> (Vec<usize>, PickReason) {
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        let key = |c: &Candidate| {
            (
                !c.usable,
                self.saturated(&c.load),
                std::cmp::Reverse(self.useful_match(c.matched_blocks)),
                c.load.waiting,
                c.load.pending_prefill_tokens,
                c.load.running,
            )
        };
        order.sort_by(|&a, &b| match (candidates.get(a), candidates.get(b)) {
            (Some(x), Some(y)) => key(x).cmp(&key(y)).then(
                x.load
                    .kv_cache_usage
                    .partial_cmp(&y.load.kv_cache_usage)
                    .unwrap_or(std::cmp::Ordering::Equal),
            ),
            _ => std::cmp::Ordering::Equal,
        });
        let Some(first) = order.first().and_then(|&i| candidates.get(i)) else {
            return (order, PickReason::NoCandidates);
        };
        let best_usable_match = candidates
            .iter()
            .filter(|c| c.usable)
            .map(|c| self.useful_match(c.matched_blocks))
            .max()
            .unwrap_or(0);
        let chosen = self.useful_match(first.matched_blocks);
        let reason = if best_usable_match > chosen {
            PickReason::Saturated
        } else if chosen > 0 {
            PickReason::Prefix
        } else {
            PickReason::Load
        };
        (order, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(matched: usize, waiting: u32) -> Candidate {
        Candidate {
            matched_blocks: matched,
            load: Load {
                waiting,
                ..Load::default()
            },
            usable: true,
        }
    }

    #[test]
    fn longest_prefix_wins_while_not_saturated() {
        let policy = PickPolicy::default();
        let (order, reason) = policy.rank(&[c(2, 0), c(9, 3), c(0, 0)]);
        assert_eq!((order, reason), (vec![1, 0, 2], PickReason::Prefix));
    }

    #[test]
    fn affinity_yields_to_load_past_saturation() {
        let policy = PickPolicy::default();
        let (order, reason) = policy.rank(&[c(0, 1), c(9, 8)]);
        assert_eq!((order, reason), (vec![0, 1], PickReason::Saturated));
    }

    #[test]
    fn without_a_useful_prefix_the_least_loaded_goes_first() {
        let policy = PickPolicy {
            min_matched_blocks: 2,
            ..PickPolicy::default()
        };
        let (order, reason) = policy.rank(&[c(1, 3), c(1, 1), c(0, 2)]);
        assert_eq!((order, reason), (vec![1, 2, 0], PickReason::Load));
    }

    #[test]
    fn pending_prefill_breaks_ties_and_saturates() {
        let policy = PickPolicy::default();
        let mut busy = c(4, 0);
        busy.load.pending_prefill_tokens = 1000;
        let idle = c(4, 0);
        assert_eq!(policy.rank(&[busy, idle]).0, vec![1, 0]);
        busy.load.pending_prefill_tokens = policy.max_pending_prefill_tokens;
        let (order, reason) = policy.rank(&[busy, c(0, 0)]);
        assert_eq!((order, reason), (vec![1, 0], PickReason::Saturated));
    }

    #[test]
    fn unusable_replicas_rank_last_and_nothing_ranks_nothing() {
        let policy = PickPolicy::default();
        let mut broken = c(9, 0);
        broken.usable = false;
        assert_eq!(
            policy.rank(&[broken, c(0, 5)]),
            (vec![1, 0], PickReason::Load)
        );
        assert_eq!(policy.rank(&[]), (vec![], PickReason::NoCandidates));
    }
}
