//! Choosing a replica: the longest cached prefix wins, until that replica is saturated.
//!
//! The policy ("sticky until saturated") and its knobs are documented in
//! `docs/daemon.md`. It is a pure function of the candidates, so the daemon, the
//! benchmarks and the tests all rank identically. Work is weighed in seconds at each
//! replica's own [prefill speed](PrefillSpeed), so a slow replica of a mixed fleet gets
//! less of it.

use crate::reason::Reason;

/// What is known of a replica's load, from its `/metrics` and from recent picks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc`, a fraction 0-1.
    pub kv_cache_usage: f64,
    /// Prefill work (computed-token equivalents) routed to the replica and not yet done
    /// by its estimated prefill speed: the queue a new request would wait behind.
    pub pending_prefill_tokens: u64,
}

/// How fast a replica prefills: what turns the work queued on it, and a request's own
/// work, into the seconds a request waits there. Work is counted in computed-token
/// equivalents: a computed token is one, a cached one [`cached_token_cost`], and each
/// computed token pays [`context_cost`] more per token of context it attends over. The
/// daemon learns all four figures from each replica's metrics; replicas with the same
/// figures rank exactly as if work were counted in tokens.
///
/// The context term is what real vLLM showed (`cargo xtask bench prefill-shape`, vLLM
/// 0.32.0 on a CPU): 7,168 cold tokens took 14.7 times as long as 1,024, and 32 new tokens
/// after 7,168 cached took 55 ms where a fixed share per cached token said 314. A GPU
/// replica reading long cached contexts shows the per-cached-token cost instead (the
/// emulator's calibration); the fit finds which.
///
/// [`cached_token_cost`]: Self::cached_token_cost
/// [`context_cost`]: Self::context_cost
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillSpeed {
    /// Computed prompt tokens prefilled per second.
    pub tokens_per_second: f64,
    /// A request's fixed cost (scheduling, sampling setup), in computed-token equivalents.
    pub overhead_tokens: f64,
    /// What a cached prompt token costs against a computed one (reading its KV).
    pub cached_token_cost: f64,
    /// What a computed token costs more, against its own cost, per token of context before
    /// it (its attention over the prompt so far).
    pub context_cost: f64,
}

impl PrefillSpeed {
    /// Assumed before anything is measured: about one GPT-OSS-20B GPU (the emulator's
    /// calibration), a 40 ms fixed cost per request, a cached token at a tenth of a
    /// computed one.
    pub const DEFAULT: Self = Self {
        tokens_per_second: 5000.0,
        overhead_tokens: 200.0,
        cached_token_cost: 0.1,
        context_cost: 0.0,
    };

    /// Seconds to prefill `tokens` computed-token equivalents.
    pub fn seconds(&self, tokens: f64) -> f64 {
        tokens / self.tokens_per_second
    }

    /// Seconds a request alone takes to prefill, its fixed cost included, with its first
    /// `cached` prompt tokens served from the cache and the next `computed` computed.
    pub fn request_seconds(&self, computed: f64, cached: f64) -> f64 {
        self.seconds(self.overhead_tokens + self.work(computed, cached))
    }

    /// The work, in computed-token equivalents, of a prompt whose first `cached` tokens are
    /// served from the cache and whose next `computed` are computed: each computed token
    /// attends over the cached ones and, on average, half the computed ones.
    pub fn work(&self, computed: f64, cached: f64) -> f64 {
        computed
            + self.cached_token_cost * cached
            + self.context_cost * computed * (cached + computed / 2.0)
    }
}

impl Default for PrefillSpeed {
    fn default() -> Self {
        Self::DEFAULT
    }
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
    /// Its event stream is lost (the replica stopped, crashed or is restarting): ranked
    /// after every other, usable or not, whatever it holds.
    pub gone: bool,
    /// How fast it prefills.
    pub speed: PrefillSpeed,
}

/// Whether a request's cached prefix is one that many requests want at once (a hot system
/// prompt): then a replica holding it that has a queue is worth relieving. Sending a
/// request to an idle replica that holds nothing costs one cold prefill, once, after which
/// that replica serves the prefix warm too; queueing it behind a warm replica delays it and
/// every request after it there. So for such a prefix a candidate's queue counts twice: the
/// wait it costs this request, and the wait this request adds to the next ones. A prefix
/// one conversation wants (its own history) is not worth the cold prefill: its queue counts
/// once, and the request's own prefill twice (the wait it costs this request, and the wait
/// it adds to the next one on that replica), so leaving the warm replica must save what the
/// recomputed prefix costs the fleet, not only this request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Demand {
    /// One conversation's prefix (or nothing known of others wanting it).
    #[default]
    Own,
    /// A prefix other requests want at the same time.
    Shared,
}

/// The knobs of the ranking.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PickPolicy {
    /// Tokens per block (to turn matches into tokens).
    pub block_size: usize,
    /// A replica with this many more waiting requests than the least-waiting usable
    /// replica is saturated.
    pub max_waiting: u32,
    /// A replica with this many seconds of pending prefill, at its own speed, is
    /// saturated.
    pub max_pending_prefill_seconds: f64,
    /// A replica with this many pending prefill tokens is saturated, whatever its speed
    /// (an operator's override; none by default).
    pub max_pending_prefill_tokens: Option<u64>,
    /// Matches shorter than this count as no match, so a short prefix every replica shares
    /// (a system prompt) does not pull traffic onto one replica.
    pub min_matched_blocks: usize,
}

/// 65,536 tokens at the [default speed](PrefillSpeed::DEFAULT): the token bound kvaffined
/// had before it measured speeds, so an unmeasured fleet saturates where it did.
pub const DEFAULT_MAX_PENDING_PREFILL_SECONDS: f64 = 65_536.0 / 5000.0;

impl Default for PickPolicy {
    fn default() -> Self {
        Self {
            block_size: 16,
            max_waiting: 8,
            max_pending_prefill_seconds: DEFAULT_MAX_PENDING_PREFILL_SECONDS,
            max_pending_prefill_tokens: None,
            min_matched_blocks: 1,
        }
    }
}

impl PickPolicy {
    /// Whether `c` is ranked after every unsaturated replica whatever it holds: too many
    /// waiting, or too much prefill queued (seconds at its own speed, or the operator's
    /// token bound). Public so that a pick that passed over a match can say why.
    ///
    /// Waiting counts against the [least-waiting](Self::least_waiting) usable replica's:
    /// a queue is worth leaving only for a clearly shorter one. Counted from zero, a fleet
    /// evenly loaded near `max_waiting` (32 sessions on two emulated replicas, each
    /// prefilling one request at a time) passed over a warm replica that scraped 8 waiting
    /// for one that scraped 3 and recomputed a 41-block prefix there (the daemon's debug
    /// log, 2026-12-05), until that one's queue turned the flow back.
    pub fn saturated(&self, c: &Candidate, least_waiting: u32) -> bool {
        let pending = c.load.pending_prefill_tokens;
        c.load.waiting >= least_waiting.saturating_add(self.max_waiting)
            || match self.max_pending_prefill_tokens {
                Some(max) => pending >= max,
                None => c.speed.seconds(pending as f64) >= self.max_pending_prefill_seconds,
            }
    }

    /// The fewest waiting requests of any usable replica whose stream is there: what
    /// [`saturated`](Self::saturated) counts a replica's waiting against (0 when none is
    /// usable, so waiting then counts from zero).
    pub fn least_waiting(candidates: &[Candidate]) -> u32 {
        candidates
            .iter()
            .filter(|c| c.usable && !c.gone)
            .map(|c| c.load.waiting)
            .min()
            .unwrap_or(0)
    }

    fn useful_match(&self, matched: usize) -> usize {
        if matched >= self.min_matched_blocks {
            matched
        } else {
            0
        }
    }

    /// The seconds, at the candidate's own speed, of the prefill that sending a request of
    /// `request_blocks` blocks there would queue behind and add: its pending prefill
    /// (picks booked on it that its events have not confirmed yet), the request's own
    /// [prefill work](Self::prefill_work) and its fixed cost.
    ///
    /// Waiting requests from `/metrics` are not costed: scraped every half second they lag
    /// the bookings, and counting them as full requests made affinity leave warm replicas
    /// too early (the scenario benchmark's hot-system-prompt and template-divergence runs
    /// lost hit rate and TTFT with it); they saturate a replica and break ties instead.
    /// A prefix in [`Demand::Shared`] counts the pending prefill twice, one in
    /// [`Demand::Own`] the request's own prefill (see [`Demand`]).
    ///
    /// Own prefill counted once, a session under concurrency (32 sessions on 4 emulated
    /// replicas) left its warm replica whenever the queue there passed 0.9 of its cached
    /// prefix, for a TTFT a few milliseconds lower (debug logs of `bench scenarios
    /// concurrency`, 2026-12-04): 0.94 of the oracle's hit rate.
    pub fn cost(&self, request_blocks: usize, c: &Candidate, demand: Demand) -> f64 {
        let (queues, own) = match demand {
            Demand::Own => (1.0, 2.0),
            Demand::Shared => (2.0, 1.0),
        };
        c.speed.seconds(
            queues * c.load.pending_prefill_tokens as f64
                + own * self.prefill_work(request_blocks, c.matched_blocks, &c.speed)
                + c.speed.overhead_tokens,
        )
    }

    /// The prefill, in computed-token equivalents at `speed`'s [work](PrefillSpeed::work),
    /// of a request of `request_blocks` blocks on a replica holding its first
    /// `matched_blocks`. What a pick adds to its replica's queue, and what ranking weighs.
    pub fn prefill_work(
        &self,
        request_blocks: usize,
        matched_blocks: usize,
        speed: &PrefillSpeed,
    ) -> f64 {
        let matched = self.useful_match(matched_blocks).min(request_blocks);
        let block = self.block_size as f64;
        speed.work(
            (request_blocks - matched) as f64 * block,
            matched as f64 * block,
        )
    }

    /// Candidate indices, best first, and why the first is first, for a request of
    /// `request_blocks` blocks.
    ///
    /// Order: replicas whose stream is there before those whose stream is gone; usable
    /// before unusable; unsaturated before saturated; then the least
    /// [prefill cost](Self::cost), so a long cached prefix wins until the queue in front
    /// of it costs more than recomputing the prefix elsewhere; then fewer waiting, fewer
    /// running, lower KV usage; then input order starting at `rotation` (modulo the
    /// candidates), so that requests nothing tells apart (new prompts on idle replicas,
    /// between two scrapes) take turns instead of all going to the first replica.
    pub fn rank(
        &self,
        request_blocks: usize,
        candidates: &[Candidate],
        rotation: usize,
    ) -> (Vec<usize>, Reason) {
        self.rank_top(
            request_blocks,
            candidates,
            rotation,
            Demand::Own,
            usize::MAX,
        )
    }

    /// [`rank`](Self::rank)'s first `top` candidates in its order, then the others in
    /// none: all an answer of `top` candidates reads, at a cost linear in the fleet. Queues
    /// are weighed as `demand` says.
    pub fn rank_top(
        &self,
        request_blocks: usize,
        candidates: &[Candidate],
        rotation: usize,
        demand: Demand,
        top: usize,
    ) -> (Vec<usize>, Reason) {
        // Each candidate's key is made once, not at every comparison, and only the top
        // are sorted: a comparator sort of 1,024 replicas took 12% of the time of
        // `cargo xtask bench scale`. Keys differ in `turn`, so no two tie and an
        // unstable sort or selection orders them as a stable sort would.
        let least_waiting = Self::least_waiting(candidates);
        let mut keyed: Vec<(RankKey, usize)> = (0..candidates.len())
            .filter_map(|i| {
                let at = Position {
                    rotation,
                    least_waiting,
                    i,
                };
                Some((self.key(request_blocks, candidates, demand, at)?, i))
            })
            .collect();
        let top = top.max(1);
        if top < keyed.len() {
            keyed.select_nth_unstable(top);
            if let Some(head) = keyed.get_mut(..top) {
                head.sort_unstable();
            }
        } else {
            keyed.sort_unstable();
        }
        let order: Vec<usize> = keyed.iter().map(|(_, i)| *i).collect();
        let Some(first) = order.first().and_then(|&i| candidates.get(i)) else {
            return (order, Reason::NoCandidates);
        };
        let best_usable_match = candidates
            .iter()
            .filter(|c| c.usable && !c.gone)
            .map(|c| self.useful_match(c.matched_blocks))
            .max()
            .unwrap_or(0);
        let chosen = self.useful_match(first.matched_blocks);
        let reason = if best_usable_match > chosen {
            Reason::Saturated
        } else if chosen > 0 {
            Reason::Prefix
        } else {
            Reason::Load
        };
        (order, reason)
    }

    /// The usable candidate a request with nothing cached anywhere would be ranked first
    /// at: where a tokenizer call is cheapest. One pass, no ordering of the rest (every
    /// lookup asks). A request of no blocks costs the queue in front of it and the
    /// replica's fixed cost, at its speed, whatever a candidate holds.
    pub fn least_busy(&self, candidates: &[Candidate], rotation: usize) -> Option<usize> {
        let least_waiting = Self::least_waiting(candidates);
        (0..candidates.len())
            .filter(|&i| candidates.get(i).is_some_and(|c| c.usable && !c.gone))
            .min_by_key(|&i| {
                let at = Position {
                    rotation,
                    least_waiting,
                    i,
                };
                self.key(0, candidates, Demand::Own, at)
            })
    }

    /// Candidate `i`'s place in [`rank`](Self::rank)'s order, as a key compared field by
    /// field.
    fn key(
        &self,
        request_blocks: usize,
        candidates: &[Candidate],
        demand: Demand,
        at: Position,
    ) -> Option<RankKey> {
        let Position {
            rotation,
            least_waiting,
            i,
        } = at;
        let c = candidates.get(i)?;
        let n = candidates.len().max(1);
        Some(RankKey {
            gone: c.gone,
            unusable: !c.usable,
            saturated: self.saturated(c, least_waiting),
            cost: Seconds(self.cost(request_blocks, c, demand)),
            waiting: c.load.waiting,
            running: c.load.running,
            kv_cache_usage: Seconds(c.load.kv_cache_usage),
            turn: (i + n - rotation % n) % n,
        })
    }
}

/// Which candidate a [`RankKey`] is made for, with what the fleet around it sets: the
/// lookup's rotation and the fewest waiting.
#[derive(Clone, Copy, Debug)]
struct Position {
    rotation: usize,
    least_waiting: u32,
    i: usize,
}

/// A candidate's rank, field by field, first difference deciding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct RankKey {
    gone: bool,
    unusable: bool,
    saturated: bool,
    cost: Seconds,
    waiting: u32,
    running: u32,
    kv_cache_usage: Seconds,
    turn: usize,
}

/// A float ordered by [`f64::total_cmp`], so a key can derive its order.
#[derive(Clone, Copy, Debug)]
struct Seconds(f64);

impl PartialEq for Seconds {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Seconds {}

impl PartialOrd for Seconds {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Seconds {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
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
            gone: false,
            speed: PrefillSpeed::DEFAULT,
        }
    }

    #[test]
    fn the_top_of_a_ranking_is_the_full_rankings_head() {
        let policy = PickPolicy::default();
        let mut state = 3u64;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            state >> 33
        };
        for round in 0..200 {
            let candidates: Vec<Candidate> = (0..(1 + next() % 40))
                .map(|_| {
                    let mut c = c((next() % 6) as usize, (next() % 10) as u32);
                    c.load.pending_prefill_tokens = next() % 3 * 20_000;
                    c.usable = next() % 7 != 0;
                    c
                })
                .collect();
            let (full, reason) = policy.rank(5, &candidates, round);
            let top = (next() % 5) as usize;
            let (head, head_reason) = policy.rank_top(5, &candidates, round, Demand::Own, top);
            let shown = top.max(1).min(full.len());
            assert_eq!(head[..shown], full[..shown]);
            assert_eq!(head_reason, reason);
            let mut all = head.clone();
            all.sort_unstable();
            assert_eq!(all, (0..candidates.len()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn longest_prefix_wins_while_not_saturated() {
        let policy = PickPolicy::default();
        let (order, reason) = policy.rank(10, &[c(2, 0), c(9, 0), c(0, 1)], 0);
        assert_eq!((order, reason), (vec![1, 0, 2], Reason::Prefix));
    }

    #[test]
    fn affinity_yields_to_load_past_saturation() {
        let policy = PickPolicy::default();
        let (order, reason) = policy.rank(10, &[c(0, 1), c(9, 9)], 0);
        assert_eq!((order, reason), (vec![0, 1], Reason::Saturated));
    }

    #[test]
    fn waiting_saturates_only_against_a_shorter_queue() {
        let policy = PickPolicy::default();
        // Evenly loaded past the bound: leaving would forfeit the prefix for no shorter
        // wait, so the warm replica keeps the request...
        assert_eq!(
            policy.rank(10, &[c(0, 7), c(9, 8)], 0),
            (vec![1, 0], Reason::Prefix)
        );
        assert_eq!(
            policy.rank(10, &[c(0, 12), c(9, 19)], 0),
            (vec![1, 0], Reason::Prefix)
        );
        // ...until its queue is the bound longer than the shortest usable one.
        assert_eq!(
            policy.rank(10, &[c(0, 12), c(9, 20)], 0),
            (vec![0, 1], Reason::Saturated)
        );
        // A replica that cannot take the request does not shorten the shortest queue.
        let mut broken = c(0, 0);
        broken.usable = false;
        let mut gone = c(0, 0);
        gone.gone = true;
        assert_eq!(
            policy.rank(10, &[broken, gone, c(0, 7), c(9, 8)], 0).0[0],
            3
        );
        assert_eq!(PickPolicy::least_waiting(&[broken, gone]), 0);
    }

    #[test]
    fn without_a_useful_prefix_the_least_loaded_goes_first() {
        let policy = PickPolicy {
            min_matched_blocks: 2,
            ..PickPolicy::default()
        };
        let (order, reason) = policy.rank(10, &[c(1, 3), c(1, 1), c(0, 2)], 0);
        assert_eq!((order, reason), (vec![1, 2, 0], Reason::Load));
    }

    #[test]
    fn a_conversation_leaves_its_warm_replica_only_if_the_move_pays_for_the_recompute() {
        let policy = PickPolicy::default();
        // 100 blocks held: 160 tokens of cached work against 1,600 cold, each counted
        // twice, plus 200 fixed: the warm replica keeps the request until its queue passes
        // 2,880 tokens (1.8x the prefix), where this request alone would gain at 1,440.
        let mut warm = c(100, 0);
        let idle = c(0, 0);
        for (queued, order) in [
            (1_500, vec![0, 1]),
            (2_800, vec![0, 1]),
            (3_000, vec![1, 0]),
        ] {
            warm.load.pending_prefill_tokens = queued;
            assert_eq!(
                policy.rank_top(100, &[warm, idle], 0, Demand::Own, 2).0,
                order,
                "{queued}"
            );
        }
    }

    #[test]
    fn work_charges_each_computed_token_for_the_context_before_it() {
        let attention = PrefillSpeed {
            cached_token_cost: 0.0,
            context_cost: 0.001,
            ..PrefillSpeed::DEFAULT
        };
        // 1,000 cold tokens attend over 500 on average: 1,000 x (1 + 0.5).
        assert_eq!(attention.work(1000.0, 0.0), 1500.0);
        // 10 new tokens after 1,000 cached attend over 1,005 each; the cached ones cost
        // nothing of their own.
        assert!((attention.work(10.0, 1000.0) - 20.05).abs() < 1e-9);
        // The default is the linear model: a cached token at a tenth of a computed one.
        assert_eq!(PrefillSpeed::DEFAULT.work(10.0, 1000.0), 110.0);
        // Alone, with its fixed cost: 200 + 110 tokens at 5,000 tokens/s.
        assert!((PrefillSpeed::DEFAULT.request_seconds(10.0, 1000.0) - 0.062).abs() < 1e-12);
    }

    #[test]
    fn a_replica_that_pays_for_context_keeps_a_conversation_against_a_longer_queue() {
        let policy = PickPolicy::default();
        let attention = PrefillSpeed {
            cached_token_cost: 0.0,
            context_cost: 0.0005,
            ..PrefillSpeed::DEFAULT
        };
        // 99 of 100 blocks held. The linear default: 16 + 158.4 tokens of work warm against
        // 1,600 cold, each counted twice, so a queue of 2,852 tokens sends the request
        // away. With context: 28.7 warm against 2,240 cold, and it stays until 4,423.
        let mut warm = c(99, 0);
        let idle = c(0, 0);
        warm.load.pending_prefill_tokens = 3_500;
        assert_eq!(
            policy.rank_top(100, &[warm, idle], 0, Demand::Own, 2),
            (vec![1, 0], Reason::Saturated)
        );
        let (mut warm, mut idle) = (warm, idle);
        warm.speed = attention;
        idle.speed = attention;
        assert_eq!(
            policy.rank_top(100, &[warm, idle], 0, Demand::Own, 2),
            (vec![0, 1], Reason::Prefix)
        );
        warm.load.pending_prefill_tokens = 4_500;
        assert_eq!(
            policy.rank_top(100, &[warm, idle], 0, Demand::Own, 2).0,
            vec![1, 0]
        );
    }

    #[test]
    fn a_prefix_in_demand_leaves_a_queue_for_an_idle_replica_sooner() {
        let policy = PickPolicy::default();
        // 100 blocks held by a replica with 900 tokens queued: 100 cached blocks' work
        // (160 tokens) + 900 + 200 fixed, against 1,600 cold + 200 on an idle replica.
        let mut warm = c(100, 0);
        warm.load.pending_prefill_tokens = 900;
        let idle = c(0, 0);
        let rank = |demand| policy.rank_top(100, &[warm, idle], 0, demand, 2);
        assert_eq!(rank(Demand::Own), (vec![0, 1], Reason::Prefix));
        assert_eq!(rank(Demand::Shared), (vec![1, 0], Reason::Saturated));
        // Without a queue, the warm replica wins either way.
        warm.load.pending_prefill_tokens = 0;
        assert_eq!(
            policy.rank_top(100, &[warm, idle], 0, Demand::Shared, 2).0,
            vec![0, 1]
        );
    }

    #[test]
    fn pending_prefill_breaks_ties_and_saturates() {
        let policy = PickPolicy::default();
        let mut busy = c(4, 0);
        busy.load.pending_prefill_tokens = 1000;
        let idle = c(4, 0);
        assert_eq!(policy.rank(10, &[busy, idle], 0).0, vec![1, 0]);
        busy.load.pending_prefill_tokens = 65_536;
        let (order, reason) = policy.rank(10, &[busy, c(0, 0)], 0);
        assert_eq!((order, reason), (vec![1, 0], Reason::Saturated));
        // Saturation comes before cost: an idle but slow replica (10 cold blocks: 3.6 s)
        // goes before 13.1 s of queue on the default speed...
        let mut slow = c(0, 0);
        slow.speed.tokens_per_second = 100.0;
        assert_eq!(policy.rank(10, &[busy, slow], 0).0, vec![1, 0]);
        // ...but the same queue on a replica ten times as fast is 1.3 s of work, not
        // saturation; an operator's token bound saturates it whatever its speed.
        busy.speed.tokens_per_second = 50_000.0;
        assert_eq!(policy.rank(10, &[busy, slow], 0).0, vec![0, 1]);
        let bounded = PickPolicy {
            max_pending_prefill_tokens: Some(65_536),
            ..policy
        };
        assert_eq!(bounded.rank(10, &[busy, slow], 0).0, vec![1, 0]);
    }

    #[test]
    fn work_weighs_in_seconds_at_each_replicas_own_speed() {
        let policy = PickPolicy::default();
        let mut slow = c(0, 0);
        slow.speed.tokens_per_second = 2500.0;
        let mut fast = c(0, 0);
        fast.load.pending_prefill_tokens = 1500;
        // 100 cold blocks: 1,600 tokens counted twice (its own wait and the next
        // request's) and 200 of overhead, 3,400 in all; 1.36 s on the idle slow replica,
        // 0.98 s behind 1,500 queued tokens on the fast one, 1.38 s behind 3,500.
        assert_eq!(
            policy.rank(100, &[slow, fast], 0),
            (vec![1, 0], Reason::Load)
        );
        fast.load.pending_prefill_tokens = 3500;
        assert_eq!(policy.rank(100, &[slow, fast], 0).0, vec![0, 1]);
        // Equal speeds rank as tokens did, whatever the speed.
        let (mut a, mut b) = (c(0, 0), c(0, 0));
        a.load.pending_prefill_tokens = 10;
        for speed in [1.0, 5000.0, 1e9] {
            a.speed.tokens_per_second = speed;
            b.speed.tokens_per_second = speed;
            assert_eq!(policy.rank(100, &[a, b], 0).0, vec![1, 0], "{speed}");
        }
    }

    #[test]
    fn unusable_replicas_rank_last_and_nothing_ranks_nothing() {
        let policy = PickPolicy::default();
        let mut broken = c(9, 0);
        broken.usable = false;
        assert_eq!(
            policy.rank(10, &[broken, c(0, 5)], 0),
            (vec![1, 0], Reason::Load)
        );
        assert_eq!(policy.rank(10, &[], 0), (vec![], Reason::NoCandidates));
    }

    #[test]
    fn a_replica_whose_stream_is_gone_ranks_after_all_others() {
        let policy = PickPolicy::default();
        let mut gone = c(9, 0);
        gone.gone = true;
        let mut unscraped = c(0, 0);
        unscraped.usable = false;
        assert_eq!(
            policy.rank(10, &[gone, unscraped], 0),
            (vec![1, 0], Reason::Load)
        );
    }

    #[test]
    fn the_least_busy_ignores_what_is_cached_and_what_is_unusable() {
        let policy = PickPolicy::default();
        let mut warm_but_busy = c(9, 0);
        warm_but_busy.load.pending_prefill_tokens = 50;
        let mut broken = c(0, 0);
        broken.usable = false;
        let mut gone = c(0, 0);
        gone.gone = true;
        let candidates = [warm_but_busy, broken, gone, c(0, 2), c(0, 1)];
        assert_eq!(policy.rank(10, &candidates, 0).0.first(), Some(&0));
        assert_eq!(policy.least_busy(&candidates, 0), Some(4));
        // Ties take turns; nothing usable names nothing.
        assert_eq!(policy.least_busy(&[c(0, 0), c(0, 0)], 1), Some(1));
        assert_eq!(policy.least_busy(&[broken, gone], 0), None);
    }

    #[test]
    fn waiting_requests_break_ties_and_saturate_but_do_not_cost() {
        let policy = PickPolicy::default();
        assert_eq!(
            policy.rank(10, &[c(10, 2), c(0, 0)], 0),
            (vec![0, 1], Reason::Prefix)
        );
        assert_eq!(
            policy.rank(10, &[c(0, 2), c(0, 1)], 0),
            (vec![1, 0], Reason::Load)
        );
    }

    #[test]
    fn a_warm_replica_loses_once_its_queue_costs_more_than_recomputing_elsewhere() {
        let policy = PickPolicy::default();
        let mut warm = c(90, 0);
        warm.load.pending_prefill_tokens = 500;
        let cold = c(0, 0);
        assert_eq!(
            policy.rank(100, &[cold, warm], 0),
            (vec![1, 0], Reason::Prefix)
        );
        // 100 blocks of 16 tokens cost 1,600 cold; behind 20,000 queued tokens warm costs more.
        warm.load.pending_prefill_tokens = 20_000;
        assert_eq!(
            policy.rank(100, &[cold, warm], 0),
            (vec![0, 1], Reason::Saturated)
        );
    }

    #[test]
    fn requests_nothing_tells_apart_take_turns() {
        let policy = PickPolicy::default();
        let idle = [c(0, 0), c(0, 0), c(0, 0)];
        let firsts: Vec<usize> = (0..6)
            .map(|turn| policy.rank(10, &idle, turn).0[0])
            .collect();
        assert_eq!(firsts, [0, 1, 2, 0, 1, 2]);
        // Anything that tells them apart still decides.
        assert_eq!(policy.rank(10, &[c(0, 0), c(5, 0), c(0, 0)], 2).0[0], 1);
    }
}
