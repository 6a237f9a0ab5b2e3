//! A replica's KV-cache groups, as its events reveal them, and the hit vLLM serves over
//! them.
//!
//! A model that mixes attention types (GPT-OSS, Gemma 2/3: sliding-window layers between
//! full-attention ones) has one KV-cache group per type, each caching and evicting its own
//! blocks under the one hash chain. vLLM (0.32's `HybridKVCacheCoordinator`) serves a
//! prefix from cache only where every group can: the full-attention groups from block 0
//! up, and each sliding-window group the window of blocks just before the hit point. The
//! groups are learned from the events (`group_idx`, `kv_cache_spec_kind`,
//! `kv_cache_spec_sliding_window`): vLLM's `cache_config_info` metric does not name them.

use kvaffine_core::events::BlockStored;
use serde::Serialize;

use crate::index::{GPU, Group};

/// The index group an event names; `None` for a number no group can have.
pub fn group_of(group_idx: Option<i64>) -> Option<Group> {
    group_idx.map_or(Some(0), |g| Group::try_from(g).ok())
}

/// The event's name for a full-attention group.
pub const FULL_ATTENTION: &str = "full_attention";
/// The event's name for a sliding-window group.
pub const SLIDING_WINDOW: &str = "sliding_window";

/// One KV-cache group of a replica, as `/v1/endpoints` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KvCacheGroup {
    /// `group_idx` in its events.
    pub group: Group,
    /// `kv_cache_spec_kind` (`full_attention` for a version that does not say).
    pub kind: String,
    /// `kv_cache_spec_sliding_window`, in tokens.
    pub sliding_window: Option<u64>,
    /// The block size its events report.
    pub block_size: u64,
}

/// The groups one replica has published, in group order; empty until its first store,
/// read as one full-attention group (what every replica without hybrid attention is).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Layout(Vec<KvCacheGroup>);

/// How a lookup reads a replica's groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The hit is the longest prefix of these full-attention groups (all must hold it).
    Prefix(Vec<Group>),
    /// Full attention, then each window group's run of blocks before the hit point.
    Hybrid {
        /// The full-attention groups.
        full: Vec<Group>,
        /// Each sliding-window group, and the blocks before a hit point it must hold:
        /// `ceil((window - 1) / block_size)`, vLLM's count.
        windows: Vec<(Group, usize)>,
    },
    /// kvaffine cannot follow these groups, and says why; it predicts no hit.
    Unsupported(String),
}

impl Default for Rule {
    /// One full-attention group 0: a replica before its first store.
    fn default() -> Self {
        Self::Prefix(vec![0])
    }
}

impl Rule {
    /// One full-attention group 0, the rule of every replica that is not hybrid: read
    /// without building [`Rule::default`] on every lookup.
    pub fn is_plain(&self) -> bool {
        matches!(self, Rule::Prefix(groups) if groups.as_slice() == [0])
    }
}

impl Layout {
    /// Records the group a store names; true if the layout changed.
    pub fn learn(
        &mut self,
        group: Group,
        kind: Option<&str>,
        sliding_window: Option<i64>,
        block_size: u64,
    ) -> bool {
        let seen = KvCacheGroup {
            group,
            kind: kind.unwrap_or(FULL_ATTENTION).to_owned(),
            sliding_window: sliding_window.and_then(|w| u64::try_from(w).ok()),
            block_size,
        };
        match self.0.binary_search_by_key(&group, |g| g.group) {
            Ok(at) if self.0.get(at) == Some(&seen) => false,
            Ok(at) => {
                if let Some(known) = self.0.get_mut(at) {
                    *known = seen;
                }
                true
            }
            Err(at) => {
                self.0.insert(at, seen);
                true
            }
        }
    }

    /// Records the group a GPU-tier store names (an offloading tier may store in other
    /// units); true if the layout changed.
    pub fn learn_store(&mut self, event: &BlockStored) -> bool {
        let gpu = event.medium.as_deref().unwrap_or(GPU) == GPU;
        match group_of(event.group_idx) {
            Some(group) if gpu => self.learn(
                group,
                event.kv_cache_spec_kind.as_deref(),
                event.kv_cache_spec_sliding_window,
                event.block_size,
            ),
            _ => false,
        }
    }

    /// The groups seen so far.
    pub fn groups(&self) -> &[KvCacheGroup] {
        &self.0
    }

    /// How lookups read this replica, for kvaffine's `block_size`.
    pub fn rule(&self, block_size: u64) -> Rule {
        if self.0.is_empty() {
            return Rule::default();
        }
        let mut full = Vec::new();
        let mut windows = Vec::new();
        for g in &self.0 {
            if g.block_size != block_size {
                return Rule::Unsupported(format!(
                    "KV-cache group {} ({}) has block size {}, kvaffine keys blocks of {block_size}",
                    g.group, g.kind, g.block_size
                ));
            }
            match (g.kind.as_str(), g.sliding_window) {
                (FULL_ATTENTION, _) => full.push(g.group),
                (SLIDING_WINDOW, Some(window)) if window > 0 => {
                    let before = window.saturating_sub(1).div_ceil(block_size.max(1));
                    windows.push((g.group, usize::try_from(before).unwrap_or(usize::MAX)));
                }
                (kind, _) => {
                    return Rule::Unsupported(format!(
                        "KV-cache group {} is {kind}{}: kvaffine does not know how vLLM serves it, so it predicts no hit on this replica",
                        g.group,
                        g.sliding_window
                            .map_or(String::new(), |w| format!(" (window {w})"))
                    ));
                }
            }
        }
        match (full.is_empty(), windows.is_empty()) {
            (true, _) => Rule::Unsupported(
                "no full-attention KV-cache group: kvaffine predicts no hit on this replica"
                    .to_owned(),
            ),
            (false, true) => Rule::Prefix(full),
            (false, false) => Rule::Hybrid { full, windows },
        }
    }
}

/// The blocks vLLM serves from cache when its full-attention groups hold `full` leading
/// blocks and `held(group, block)` says which blocks each sliding-window group holds.
/// Each window group in turn cuts the hit to the last point with its run of blocks before
/// it (or to a shorter run from block 0), scanning back from the current hit; with more
/// than one window group this repeats until no group cuts further, as vLLM does.
pub fn hybrid_hit(
    full: u32,
    windows: &[(Group, usize)],
    held: impl Fn(Group, usize) -> bool,
) -> u32 {
    let mut hit = full as usize;
    loop {
        let before = hit;
        for &(group, needed) in windows {
            hit = window_hit(hit, needed, |block| held(group, block));
        }
        if hit == before || hit == 0 {
            return u32::try_from(hit).unwrap_or(u32::MAX);
        }
    }
}

/// One window group's cut (vLLM's `SlidingWindowManager.find_longest_cache_hit`): scanning
/// back from `most`, the first block `i` with `needed` held blocks from it gives `i +
/// needed`; with none, the held run from block 0.
fn window_hit(most: usize, needed: usize, held: impl Fn(usize) -> bool) -> usize {
    let mut run = 0;
    for block in (0..most).rev() {
        if held(block) {
            run += 1;
            if run >= needed {
                return block + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma(window: i64) -> Layout {
        let mut layout = Layout::default();
        assert!(layout.learn(0, Some(SLIDING_WINDOW), Some(window), 32));
        assert!(layout.learn(1, Some(FULL_ATTENTION), None, 32));
        assert!(!layout.learn(1, Some(FULL_ATTENTION), None, 32));
        layout
    }

    #[test]
    fn a_window_of_128_tokens_needs_the_4_blocks_of_32_before_the_hit() {
        assert_eq!(
            gemma(128).rule(32),
            Rule::Hybrid {
                full: vec![1],
                windows: vec![(0, 4)]
            }
        );
        assert_eq!(Layout::default().rule(32), Rule::Prefix(vec![0]));
    }

    #[test]
    fn the_hit_is_the_last_point_with_the_window_before_it() {
        // Window blocks held: 55..59 (a branch point) and 77..81 (a prompt's end).
        let held = |_: Group, b: usize| (55..59).contains(&b) || (77..81).contains(&b);
        let windows = [(0, 4)];
        assert_eq!(hybrid_hit(81, &windows, held), 81);
        assert_eq!(hybrid_hit(85, &windows, held), 81);
        assert_eq!(hybrid_hit(80, &windows, held), 59);
        assert_eq!(hybrid_hit(59, &windows, held), 59);
        assert_eq!(hybrid_hit(58, &windows, held), 0);
        // A run from block 0 shorter than the window still counts.
        assert_eq!(hybrid_hit(10, &windows, |_, b| b < 2), 2);
        assert_eq!(hybrid_hit(0, &windows, |_, _| true), 0);
    }

    #[test]
    fn several_window_groups_cut_until_none_cuts_further() {
        // Group 0 holds windows ending at 20 and 12, group 2 only the one ending at 12.
        let held = |g: Group, b: usize| match g {
            0 => (16..20).contains(&b) || (8..12).contains(&b),
            _ => (10..12).contains(&b),
        };
        assert_eq!(hybrid_hit(20, &[(0, 4), (2, 2)], held), 12);
    }

    #[test]
    fn other_kinds_and_block_sizes_are_unsupported_not_guessed() {
        let mut layout = gemma(128);
        assert!(matches!(layout.rule(64), Rule::Unsupported(_)));
        layout.learn(2, Some("mamba"), None, 32);
        let Rule::Unsupported(why) = layout.rule(32) else {
            panic!("mamba was read");
        };
        assert!(why.contains("mamba"), "{why}");
        let mut windows_only = Layout::default();
        windows_only.learn(0, Some(SLIDING_WINDOW), Some(128), 32);
        assert!(matches!(windows_only.rule(32), Rule::Unsupported(_)));
    }
}
