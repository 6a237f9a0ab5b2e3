//! Each replica's prefill speed, learned from what the replica itself reports.
//!
//! vLLM observes three histograms for every finished request: the seconds it spent in
//! prefill (`vllm:request_prefill_time_seconds`, first token less first scheduled), the
//! prompt tokens it computed, cache hits left out
//! (`vllm:request_prefill_kv_computed_tokens`), and its prompt tokens
//! (`vllm:request_prompt_tokens`). Between two scrapes their `_count`, `_sum` deltas
//! describe the same requests, so each scrape that saw requests finish is one sample: `n`
//! requests, `k` computed tokens, `c` cached ones, `t` seconds. The model is the
//! ranking's own ([`PrefillSpeed::work`]): `t = a n + b k + d c + e q`, where `q` is the
//! computed tokens times the context they attend over (`k (c + k / 2)`, of the scrape's
//! average request), fitted by least squares over the samples, older samples weighing
//! less. Real vLLM on a CPU pays for context (`e`) and nothing per cached token; a GPU
//! replica reading a long cached context pays per cached token (`d`); the fit finds which,
//! and until a replica's requests have told the four apart it weighs a cached token at a
//! tenth of a computed one, as kvaffined always had. Nothing here is
//! set by hand: with no flag given, the ranking drains and weighs each replica's work at
//! what it measured.
//!
//! Until the metrics are evidence enough, the replica's KV events time it: the work of
//! the picks whose last block it stored over the time it was busy with them
//! ([`Confirmed`]): a replica is then ranked by its speed after its first prefill, where
//! its metrics need two finished requests and the scrape that reads them (on a real vLLM
//! pair, one replica 1.9x slower than the other, 32 conversations that arrived within 2 s
//! were all placed before either was measured). And while a pick is awaited the replica
//! has not finished it, which caps its speed before its first prefill ends
//! ([`capped_by_overdue`]): that pair's slow replica then got 11-12 of 32 such
//! conversations in four runs of five, against 15-16 without the cap.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvaffine_core::PrefillSpeed;
use serde::Serialize;

use crate::backlog::{Confirmed, Overdue};

/// Each new sample multiplies the weight of the older ones by this: about the last 20
/// scrapes that saw requests finish count (10 s of steady traffic at the default scrape
/// interval), so the estimate follows a replica whose load or model changes.
const DECAY: f64 = 0.95;

/// Evidence needed before a replica's own figures replace the fleet's: requests and
/// computed tokens seen in all. Below it one tiny request (a health probe, a
/// "hi") would make a fast replica look slow.
const MIN_REQUESTS: f64 = 2.0;
const MIN_COMPUTED_TOKENS: f64 = 2048.0;

/// Samples of requests that ran alone needed before they teach the shape: four figures
/// fitted to fewer than six requests would follow their noise.
const MIN_ALONE_SAMPLES: usize = 6;

/// Once requests that ran alone have been fitted, a sample that seems to have run alone
/// but took more than this many times what the fit says was not alone (requests alone came
/// within 10% of it on rows of 100 ms or more, `bench prefill-shape` on real vLLM 0.32.0; a
/// faster one is
/// always taken, a slower small one may be lost): vLLM (0.32.0's code) records a
/// request's prefill time when it finishes, so one that finished after the others of a
/// burst passes the scrapes' test of quiet with a prefill it shared. On real vLLM 0.32.0's hot
/// system prompt such samples moved the learned context cost from 5.5e-4 (the requests of
/// the warm-up, each alone) to 3.0e-3 within a run (the daemon's debug log, 2026-12-07
/// 19:06 UTC).
const MAX_ALONE_SURPRISE: f64 = 1.25;

/// Within the samples of requests alone, one that took more than this many times what the
/// fit of them all says is left out of it, the slowest first, while more than
/// [`MIN_ALONE_SAMPLES`] remain and at most a quarter are left out: it paid for something
/// the others did not. A fresh real vLLM 0.24.0 replica's first request (512 tokens, cold)
/// took 114-169 ms in seven runs where the fit of the requests after it put it at 16-23 ms,
/// and fitted with them it made the learned figures price vLLM's own prefills 28-41% off
/// (median); the rest of those requests came within 0.77-1.35 times the fit (the e2e check
/// `kvaffined_learns_what_context_costs_the_replica`, 2026-12-07 23:47 to 2026-12-08 00:38
/// UTC). Only slower samples are left out: a request alone is not sped up by anything
/// else.
const MAX_ALONE_OUTLIER: f64 = 1.5;

/// The requests alone kept for the fit, the newest: the oldest of them weighs `DECAY^63`,
/// 4% of the newest.
const ALONE_WINDOW: usize = 64;

/// Below this share of its own prediction left to the others (one less its leverage), a
/// sample all but decides a coefficient alone: without it the fit's normal matrix keeps
/// that share of its determinant (`det(G - w z z') = det(G) (1 - h)`), as a pivot below
/// [`MIN_SHAPE_CONDITION`] says the samples do not tell a column apart.
const MIN_SHARE_LEFT: f64 = MIN_SHAPE_CONDITION;

/// Samples in a row that seem alone and are too slow for the fit of requests alone that are
/// left out; one more, and that fit starts afresh: a burst's last request is one now and
/// then, after samples that were not alone; a replica that got slower makes every request
/// it serves alone so (without this, a replica slowed by more than [`MAX_ALONE_SURPRISE`]
/// was ranked at its old speed until 30 s without a request). One slowed while always
/// busy is still not followed by this fit until such a gap.
const MAX_ALONE_REJECTED: u32 = 3;

/// A busy period must be this long before its events time the replica: shorter, the
/// hops between the pick, the replica and its event (a millisecond or two on one host)
/// are most of it. The work must be [`MIN_COMPUTED_TOKENS`] too.
const MIN_TIMED_SECONDS: f64 = 0.05;

/// Below this share of its diagonal, the fit's determinant says every sample had about
/// the same tokens per request: overhead and speed cannot be told apart, and the speed is
/// the plain ratio (the overhead folded into it, right for requests of that size).
const MIN_CONDITION: f64 = 0.05;

/// Below this share of its diagonal, a pivot of the shape's fit says the samples do not
/// tell that column from the ones before it. Lower than [`MIN_CONDITION`]: which fit is
/// taken is judged by how each predicts each sample from the others, which a fit of noise
/// does badly; this bound keeps out only the near-ties of requests of about one
/// shape (a hot prompt's). The e2e check's requests alone on real vLLM 0.24.0 (cold
/// prefills of 512 to 4,096 tokens, and 32 to 1,280 after 1,024 and 4,096 cached) told the
/// context from the fixed cost and the computed tokens at 0.047, and all four terms apart
/// at 0.017.
const MIN_SHAPE_CONDITION: f64 = 0.01;

/// Requests that took less than this in prefill, on average, took no measurable time: the
/// figures are the scheduler's noise (a forward pass of one token on a GPU takes longer),
/// and a fit to them would rank such replicas at random. Such a replica is instant.
const INSTANT_SECONDS_PER_REQUEST: f64 = 0.001;

/// A scrape's seconds count for at most this many times what the fit so far expects of its
/// requests (and at least its inverse). vLLM's prefill time runs from first scheduled to
/// first token (`first_token_ts - scheduled_ts`, read in vLLM 0.32.0), so a request caught
/// mid-prefill by a stall (a frozen process, a paused host) reports the stall as prefill:
/// unbounded, one such sample can rank a replica so slow that it gets no traffic, and so
/// no sample to correct it. A real change of speed is still followed, by up to this
/// factor a sample.
const MAX_SAMPLE_SURPRISE: f64 = 8.0;

/// A replica's own figures rank it while a request finished there this recently. After
/// that it ranks at the fleet's median, and the next request that finishes there starts
/// its figures afresh: it ranks at the median again until they are evidence enough. A
/// figure is only corrected by requests the replica serves, and one that ranks it slower
/// sends new prompts elsewhere: on a real vLLM pair, a replica measured a quarter slower
/// than its peer while the host was loaded (after a `SIGSTOP`) got not one of four
/// clients' new conversations in the next 120 s. A replica that is really slower is
/// measured so again by its next few requests: the fleet pays a few requests at peer
/// speed a half-minute.
pub const CURRENT_FOR: Duration = Duration::from_secs(30);

/// Speeds are kept within these bounds: an instant replica (the emulator at time scale
/// 0 reports no prefill time) drains its queue at once, not at infinity.
const MAX_TOKENS_PER_SECOND: f64 = 1e9;
const MIN_TOKENS_PER_SECOND: f64 = 1.0;

/// Cumulative prefill figures from one scrape, summed over the replica's engines.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillCounters {
    /// `vllm:request_prefill_time_seconds_count`.
    pub requests: f64,
    /// `vllm:request_prefill_time_seconds_sum`.
    pub seconds: f64,
    /// `vllm:request_prefill_kv_computed_tokens_sum`.
    pub computed_tokens: f64,
    /// `vllm:request_prompt_tokens_sum`, when exported (else the computed tokens: nothing
    /// counts as cached).
    pub prompt_tokens: f64,
}

/// What a sample is made of, in the order of the fit's coefficients: requests, computed
/// tokens, cached tokens, and computed tokens times the context they attend over.
const FEATURES: usize = 4;
const REQUESTS: usize = 0;
const COMPUTED: usize = 1;
const CACHED: usize = 2;
const CONTEXT: usize = 3;

/// One scrape's features. A scrape sums its requests, so the context term takes each as
/// the scrape's average request (exact for a scrape of one request, the usual case at
/// half a second between scrapes; for several it mixes their shapes).
fn features(n: f64, computed: f64, cached: f64) -> [f64; FEATURES] {
    [
        n,
        computed,
        cached,
        computed * (cached + computed / 2.0) / n,
    ]
}

/// A cached token's and a token of context's cost against a computed token's.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Shape {
    cached: f64,
    context: f64,
}

impl Shape {
    /// The linear model kvaffined assumes until a replica's requests tell otherwise.
    const DEFAULT: Self = Self {
        cached: PrefillSpeed::DEFAULT.cached_token_cost,
        context: PrefillSpeed::DEFAULT.context_cost,
    };

    /// The work of a sample's features, in computed-token equivalents.
    fn work(&self, x: &[f64; FEATURES]) -> f64 {
        x[COMPUTED] + self.cached * x[CACHED] + self.context * x[CONTEXT]
    }
}

/// A fit: seconds per request and per computed token at a shape, and whether the samples
/// told the first two apart.
#[derive(Clone, Copy, Debug)]
struct Fit {
    per_request: f64,
    per_token: f64,
    shape: Shape,
    /// The fixed cost was told apart from the speed (requests of different sizes).
    told_per_request: bool,
}

impl Fit {
    /// Seconds a sample of features `x` takes by this fit.
    fn seconds(&self, x: &[f64; FEATURES]) -> f64 {
        x[REQUESTS] * self.per_request + self.per_token * self.shape.work(x)
    }
}

/// Weighted sums of the samples: the normal equations of the fit.
#[derive(Clone, Copy, Debug, Default)]
struct Sums {
    xx: [[f64; FEATURES]; FEATURES],
    xt: [f64; FEATURES],
    x: [f64; FEATURES],
    t: f64,
}

impl Sums {
    fn decay_and_add(&mut self, x: [f64; FEATURES], t: f64) {
        self.add(x, t, 1.0, DECAY);
    }

    /// Adds a sample weighing `weight` after multiplying the sums so far by `decay`.
    fn add(&mut self, x: [f64; FEATURES], t: f64, weight: f64, decay: f64) {
        for (i, xi) in x.iter().enumerate() {
            for (j, xj) in x.iter().enumerate() {
                self.xx[i][j] = self.xx[i][j] * decay + weight * xi * xj;
            }
            self.xt[i] = self.xt[i] * decay + weight * xi * t;
            self.x[i] = self.x[i] * decay + weight * xi;
        }
        self.t = self.t * decay + weight * t;
    }

    /// The fit, or None without enough evidence (`requests` and `tokens` seen in all, not
    /// decayed). `known_shape` (learned from requests that ran alone, else the default)
    /// turns each sample into one work figure, and the fit is of the fixed cost and the
    /// speed: told apart by requests of different sizes, else `known_per_request` (the
    /// last that could) and the speed that leaves, else the plain ratio.
    fn fit(
        &self,
        requests: f64,
        tokens: f64,
        known_per_request: Option<f64>,
        known_shape: Option<Shape>,
    ) -> Option<Fit> {
        let n = self.x[REQUESTS];
        if requests < MIN_REQUESTS || n <= 0.0 {
            return None;
        }
        let shape = known_shape.unwrap_or(Shape::DEFAULT);
        // Noise needs no token count to be told apart from work.
        if self.t < INSTANT_SECONDS_PER_REQUEST * n {
            return Some(Fit {
                per_request: 0.0,
                per_token: 0.0,
                shape,
                told_per_request: false,
            });
        }
        if tokens < MIN_COMPUTED_TOKENS {
            return None;
        }
        // One work figure: w = k + cached x c + context x q.
        let weights = [0.0, 1.0, shape.cached, shape.context];
        let dot = |v: &[f64; FEATURES]| -> f64 { v.iter().zip(&weights).map(|(a, b)| a * b).sum() };
        let nn = self.xx[REQUESTS][REQUESTS];
        let nw = dot(&self.xx[REQUESTS]);
        let ww: f64 = self
            .xx
            .iter()
            .zip(&weights)
            .map(|(row, w)| w * dot(row))
            .sum();
        let (nt, wt) = (self.xt[REQUESTS], dot(&self.xt));
        let w = dot(&self.x);
        let fit = |per_request, per_token, told_per_request| Fit {
            per_request,
            per_token,
            shape,
            told_per_request,
        };
        let det = nn * ww - nw * nw;
        if det > MIN_CONDITION * nn * ww {
            let per_request = (ww * nt - nw * wt) / det;
            let per_token = (nn * wt - nw * nt) / det;
            if per_request >= 0.0 && per_token > 0.0 {
                return Some(fit(per_request, per_token, true));
            }
        }
        if let Some(per_request) = known_per_request {
            let per_token = (self.t - per_request * n) / w;
            if per_token > 0.0 {
                return Some(fit(per_request, per_token, false));
            }
        }
        Some(fit(0.0, self.t / w, false))
    }
}

/// How [`fit_shape`] treats the cost of cached tokens or of context.
#[derive(Clone, Copy, Debug)]
enum Hold {
    /// Fitted to the samples.
    Fitted,
    /// Held at zero: its fit comes out below zero, or leaves the samples worse predicted.
    Zero,
    /// Held at the figure known: the samples do not tell it apart.
    Known,
}

/// A request that ran alone.
#[derive(Clone, Copy, Debug)]
struct AloneSample {
    /// Its features.
    x: [f64; FEATURES],
    /// Its prefill seconds, as vLLM reported them.
    t: f64,
}

/// The fit of the requests alone in `samples` (oldest first), each weighing `DECAY` to the
/// power of the kept samples after it, with up to a quarter of them left out as
/// [`MAX_ALONE_OUTLIER`]s, the slowest first, while more than [`MIN_ALONE_SAMPLES`] remain.
/// None when no fit of them all qualifies (see [`fit_shape`]); outliers are looked for only
/// in a fit.
fn fit_alone(samples: &VecDeque<AloneSample>, known: Shape) -> Option<Fit> {
    let fit_of = |kept: &[bool]| {
        let mut weight = 1.0;
        let weighted: Vec<(AloneSample, f64)> = samples
            .iter()
            .zip(kept)
            .rev()
            .filter(|(_, k)| **k)
            .map(|(sample, _)| {
                let this = weight;
                weight *= DECAY;
                (*sample, this)
            })
            .collect();
        fit_shape(&weighted, known)
    };
    let mut kept = vec![true; samples.len()];
    let mut fit = fit_of(&kept)?;
    let mut left_out = 0;
    while left_out < samples.len() / 4 && samples.len() - left_out > MIN_ALONE_SAMPLES {
        let slowest = samples
            .iter()
            .zip(&kept)
            .enumerate()
            .filter(|(_, (_, k))| **k)
            .map(|(i, (sample, _))| (i, surprise(sample.t, fit.seconds(&sample.x))))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let Some((at, surprise)) = slowest else { break };
        if surprise <= MAX_ALONE_OUTLIER {
            break;
        }
        if let Some(slot) = kept.get_mut(at) {
            *slot = false;
        }
        left_out += 1;
        match fit_of(&kept) {
            Some(without) => fit = without,
            None => break,
        }
    }
    Some(fit)
}

/// How many times what a fit `expected` a sample `took`: any time where none was expected
/// is infinitely many, none where none was expected once.
fn surprise(took: f64, expected: f64) -> f64 {
    if expected > 0.0 {
        took / expected
    } else if took > 0.0 {
        f64::INFINITY
    } else {
        1.0
    }
}

/// The shape of requests alone, from `samples` and their weights. The fixed cost and the
/// computed tokens are always fitted. The cost of cached tokens and that of context are
/// each fitted or held at zero when the samples tell it apart from those two (fitted with
/// them alone, its pivot is above [`MIN_SHAPE_CONDITION`] and no sample all but decides
/// it, [`MIN_SHARE_LEFT`]), else held at `known`'s figure: four fits at most. Of those with
/// no coefficient below zero, the one that best predicts each sample from the others (the
/// weighted squared error of leaving each out in turn) is taken; a fit that a sample all
/// but decides is not. A term the samples barely tell apart (the context of cold prefills
/// of 512 to 4,096 tokens, nearly the square of their size) fits their noise as well as
/// their cost, and predicts the sample left out badly. When none of those fits qualifies
/// (both terms told apart alone but not together, or a coefficient below zero in each),
/// both are held at `known`'s figures; None if even that fit does not. A term the samples
/// do not tell apart is not held at zero: a hot prompt's requests, all of one shape, would
/// explain their context by the speed and lose what other requests taught.
///
/// Fitted to their squared error alone, with only the fits of every term and those holding
/// one term at zero, the requests alone on real vLLM 0.24.0 of the e2e check found none
/// with no coefficient below zero for three requests in a row, and ranked the replica
/// meanwhile by a fit of seven of them (354,000 tokens/s after a fixed cost of 7,100
/// tokens, 2026-12-08 00:23 UTC).
fn fit_shape(samples: &[(AloneSample, f64)], known: Shape) -> Option<Fit> {
    let mut sums = Sums::default();
    for (sample, weight) in samples {
        sums.add(sample.x, sample.t, *weight, 1.0);
    }
    let seen = |i: usize| sums.xx[i][i] > 0.0;
    if !(seen(REQUESTS) && seen(COMPUTED)) {
        return None;
    }
    // The fit, and how well it predicts each sample from the others (infinite when a
    // sample all but decides a coefficient).
    let judged = |cached: Hold, context: Hold| -> Option<(Fit, f64)> {
        let columns = Columns::new(cached, context, known);
        let solved = columns.solve(&sums)?;
        let fit = columns.fit(&solved.coefficients)?;
        Some((fit, columns.left_out_error(&solved, samples)))
    };
    let told_apart = |term: usize| {
        let alone = if term == CACHED {
            Columns::new(Hold::Fitted, Hold::Zero, known)
        } else {
            Columns::new(Hold::Zero, Hold::Fitted, known)
        };
        seen(term)
            && alone
                .solve(&sums)
                .is_some_and(|solved| alone.left_out_error(&solved, samples).is_finite())
    };
    let choices = |term: usize| {
        if told_apart(term) {
            &[Hold::Fitted, Hold::Zero][..]
        } else {
            &[Hold::Known][..]
        }
    };
    let context_choices = choices(CONTEXT);
    choices(CACHED)
        .iter()
        .flat_map(|&cached| {
            context_choices
                .iter()
                .map(move |&context| (cached, context))
        })
        .filter_map(|(cached, context)| judged(cached, context))
        .filter(|(_, error)| error.is_finite())
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .or_else(|| judged(Hold::Known, Hold::Known))
        .map(|(fit, _)| fit)
}

/// One of [`fit_shape`]'s fits.
struct Columns {
    /// Each a combination of the features: the requests, the work (the computed tokens,
    /// plus the terms held at a figure), then each term fitted, cached tokens first.
    columns: Vec<[f64; FEATURES]>,
    /// How the cost of cached tokens is treated.
    cached: Hold,
    /// How the cost of context is treated.
    context: Hold,
    /// The figures the terms held at a figure are held at.
    held: Shape,
}

/// A fit's coefficients, by column, and the inverse of its normal matrix (what a sample's
/// leverage is read from).
struct Solved {
    /// By column.
    coefficients: Vec<f64>,
    /// The normal matrix's inverse, row by row.
    inverse: Vec<Vec<f64>>,
}

impl Columns {
    /// The columns of the fit that holds cached tokens and context as given.
    fn new(cached: Hold, context: Hold, held: Shape) -> Self {
        let unit = |i: usize| {
            let mut column = [0.0; FEATURES];
            column[i] = 1.0;
            column
        };
        let mut work = unit(COMPUTED);
        let mut fitted = Vec::new();
        for (feature, hold, figure) in [
            (CACHED, cached, held.cached),
            (CONTEXT, context, held.context),
        ] {
            match hold {
                Hold::Fitted => fitted.push(unit(feature)),
                Hold::Zero => {}
                Hold::Known => work[feature] = figure,
            }
        }
        let mut columns = vec![unit(REQUESTS), work];
        columns.extend(fitted);
        Self {
            columns,
            cached,
            context,
            held,
        }
    }

    /// Each column's value for a sample of features `x`.
    fn values(&self, x: &[f64; FEATURES]) -> Vec<f64> {
        self.columns
            .iter()
            .map(|column| column.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    /// The fit of `coefficients`, if none is below zero and the computed tokens cost
    /// something.
    fn fit(&self, coefficients: &[f64]) -> Option<Fit> {
        if coefficients.iter().any(|c| *c < 0.0) {
            return None;
        }
        let (&per_request, rest) = coefficients.split_first()?;
        let (&per_token, fitted) = rest.split_first()?;
        if per_token <= 0.0 {
            return None;
        }
        let mut fitted = fitted.iter().map(|c| c / per_token);
        let mut figure = |hold, held| match hold {
            Hold::Fitted => fitted.next(),
            Hold::Zero => Some(0.0),
            Hold::Known => Some(held),
        };
        let shape = Shape {
            cached: figure(self.cached, self.held.cached)?,
            context: figure(self.context, self.held.context)?,
        };
        Some(Fit {
            per_request,
            per_token,
            shape,
            told_per_request: true,
        })
    }

    /// The weighted squared error of predicting each sample from the others: its residual
    /// over one less its leverage (its own weight in its prediction), as refitting without
    /// it gives. Infinite when a sample all but decides a coefficient ([`MIN_SHARE_LEFT`]).
    fn left_out_error(&self, solved: &Solved, samples: &[(AloneSample, f64)]) -> f64 {
        let dot = |a: &[f64], b: &[f64]| -> f64 { a.iter().zip(b).map(|(x, y)| x * y).sum() };
        samples
            .iter()
            .map(|(sample, weight)| {
                let values = self.values(&sample.x);
                let predicted = dot(&values, &solved.coefficients);
                let leverage: f64 = weight
                    * values
                        .iter()
                        .zip(&solved.inverse)
                        .map(|(v, row)| v * dot(row, &values))
                        .sum::<f64>();
                let own_share_left = 1.0 - leverage;
                if own_share_left <= MIN_SHARE_LEFT {
                    return f64::INFINITY;
                }
                let residual = (sample.t - predicted) / own_share_left;
                weight * residual * residual
            })
            .sum()
    }

    /// Solves the normal equations of the fit of `sums`' seconds to the columns and inverts
    /// their matrix, by Gauss-Jordan elimination on it scaled to a unit diagonal; None if a
    /// pivot falls below [`MIN_SHAPE_CONDITION`] (the samples do not tell a column apart
    /// from the ones before it).
    fn solve(&self, sums: &Sums) -> Option<Solved> {
        let dot = |a: &[f64; FEATURES], b: &[f64; FEATURES]| -> f64 {
            a.iter().zip(b).map(|(x, y)| x * y).sum()
        };
        let gram = |a: &[f64; FEATURES], b: &[f64; FEATURES]| -> f64 {
            sums.xx
                .iter()
                .zip(a)
                .map(|(row, ai)| ai * dot(row, b))
                .sum()
        };
        let columns = &self.columns;
        let m = columns.len();
        let scale: Vec<f64> = columns.iter().map(|c| gram(c, c).sqrt()).collect();
        // Each row: the scaled matrix's, the identity's, the scaled right-hand side.
        let mut rows: Vec<Vec<f64>> = columns
            .iter()
            .zip(&scale)
            .enumerate()
            .map(|(i, (ci, si))| {
                let mut row: Vec<f64> = columns
                    .iter()
                    .zip(&scale)
                    .map(|(cj, sj)| gram(ci, cj) / (si * sj))
                    .collect();
                row.extend((0..m).map(|j| if i == j { 1.0 } else { 0.0 }));
                row.push(dot(ci, &sums.xt) / si);
                row
            })
            .collect();
        for p in 0..m {
            let pivot = rows.get(p).and_then(|row| row.get(p)).copied()?;
            // NaN fails too.
            if pivot.partial_cmp(&MIN_SHAPE_CONDITION) != Some(std::cmp::Ordering::Greater) {
                return None;
            }
            let pivot_row: Vec<f64> = rows.get(p)?.iter().map(|v| v / pivot).collect();
            for (r, row) in rows.iter_mut().enumerate() {
                if r == p {
                    row.clone_from(&pivot_row);
                    continue;
                }
                let factor = row.get(p).copied().unwrap_or(0.0);
                for (cell, above) in row.iter_mut().zip(&pivot_row) {
                    *cell -= factor * above;
                }
            }
        }
        let coefficients = rows
            .iter()
            .zip(&scale)
            .map(|(row, s)| row.get(2 * m).map(|y| y / s))
            .collect::<Option<Vec<f64>>>()?;
        let inverse = rows
            .iter()
            .zip(&scale)
            .map(|(row, si)| {
                row.iter()
                    .skip(m)
                    .take(m)
                    .zip(&scale)
                    .map(|(v, sj)| v / (si * sj))
                    .collect()
            })
            .collect();
        Some(Solved {
            coefficients,
            inverse,
        })
    }
}

/// What one replica's scrapes taught about its prefill.
#[derive(Clone, Debug, Default)]
pub struct SpeedLearner {
    last: Option<PrefillCounters>,
    sums: Sums,
    samples: u64,
    /// Requests and tokens (a cached one at the default's share) seen in all: the
    /// evidence, which decay must not wear below its threshold.
    requests: f64,
    tokens: f64,
    /// The fixed cost per request of the last fit that told it apart from the speed.
    /// Without it, a hot prompt's requests (all of one shape, nearly all cached) were fitted
    /// as a speed with no fixed cost: 20,530 tokens/s and 0 for an emulated replica of
    /// 25,575 and 205 tokens, so each such pick counted 370 tokens of the 575 it costs and
    /// the ranking drained that replica's queue faster than the replica did.
    per_request: Option<f64>,
    /// Samples of one request that ran alone (nothing else running or waiting at either
    /// scrape), the only ones the shape is fitted to: under concurrency vLLM's prefill
    /// time of a request is the time of the engine steps it shared, so such samples
    /// price the batch, not the request. On real vLLM 0.32.0's hot system prompt 10 requests of
    /// about 350 new tokens after 7.2k cached reported 2.16 s of prefill each, where one
    /// alone takes about 0.3 s; with requests of several shapes in the sums, such samples
    /// moved a learned shape from (none per cached token, 5.6e-4 per token of context) to
    /// (0.028, none) and back within the run (the daemon's debug log, 2026-12-07 18:56).
    /// The last [`ALONE_WINDOW`] of them, oldest first.
    alone: VecDeque<AloneSample>,
    /// The shape of the last fit of the samples that ran alone that told it apart, kept
    /// across gaps: it is the model's and the hardware's, and the next fit that tells it
    /// apart replaces it.
    shape: Option<Shape>,
    /// That fit, whose speed and fixed cost rank the replica (see [`Self::fitted`]).
    /// Fitted to concurrent requests as well, the fixed cost took up the batches they
    /// shared: on real vLLM 0.32.0's hot system prompt, 1.6 s per request on one replica of two
    /// (6,395 tokens at 3,988 tokens/s, against 10 ms on the other), which sent the
    /// approximate profile's new requests to the other replica until it melted (2.1 and
    /// 2.4 requests/s against 3.2 and 3.8 for load-only, 18:56 and 18:59 UTC). With only
    /// the fixed cost taken from requests alone, the speed fitted to the rest (1,100-1,550
    /// tokens/s, a quarter of what one request alone gets) priced a cold prefill on the
    /// idle replica as if it were as contended as the busy one, and that profile sent all
    /// 72 requests to one replica (19:06 and 19:11 UTC).
    alone_fit: Option<Fit>,
    /// Samples in a row that seemed alone but were slower than that fit allows: past
    /// [`MAX_ALONE_REJECTED`], the replica itself got slower, and the fit starts afresh.
    alone_rejected: u32,
    /// `--cached-token-cost`: the linear model, fitted as kvaffined always fitted it (to
    /// every sample, the shape fixed), nothing learned from requests alone.
    fixed_shape: Option<Shape>,
    /// When the last sample was taken.
    sampled_at: Option<Instant>,
    /// The figures from before the last gap of [`CURRENT_FOR`], until the samples since
    /// are evidence enough: what the fleet's median counts for the replica meanwhile.
    before_gap: Option<PrefillSpeed>,
    /// Tokens per second its events last timed, and when.
    timed: Option<(f64, Instant)>,
}

impl SpeedLearner {
    /// Learns nothing yet; with `cached_token_cost` (the operator's
    /// `--cached-token-cost`), fits the linear model with that cost per cached token and
    /// none for context, as kvaffined always did.
    pub fn new(cached_token_cost: Option<f64>) -> Self {
        let fixed_shape = cached_token_cost.map(|cached| Shape {
            cached,
            context: 0.0,
        });
        Self {
            shape: fixed_shape,
            fixed_shape,
            ..Self::default()
        }
    }

    /// Takes what the replica's events confirmed at `at`. True if the ranking's figure
    /// for it may have changed: its metrics have measured nothing yet.
    pub fn observe_confirmed(&mut self, confirmed: Confirmed, at: Instant) -> bool {
        let Confirmed { work, seconds } = confirmed;
        if !(work >= MIN_COMPUTED_TOKENS && seconds >= MIN_TIMED_SECONDS) {
            return false;
        }
        let rate = (work / seconds).clamp(MIN_TOKENS_PER_SECOND, MAX_TOKENS_PER_SECOND);
        self.timed = Some((rate, at));
        self.measured().is_none()
    }

    /// What its events timed, while its metrics have measured nothing and the last timed
    /// pick was confirmed within [`CURRENT_FOR`] before `now`. The fixed cost is the
    /// default's in seconds: the events time it with the work, and cannot tell it apart.
    pub fn timed(&self, now: Instant) -> Option<PrefillSpeed> {
        if self.measured().is_some() {
            return None;
        }
        let (tokens_per_second, at) = self.timed?;
        let default = PrefillSpeed::DEFAULT;
        let shape = self.shape.unwrap_or(Shape::DEFAULT);
        (now.saturating_duration_since(at) < CURRENT_FOR).then(|| PrefillSpeed {
            tokens_per_second,
            overhead_tokens: default.overhead_tokens / default.tokens_per_second
                * tokens_per_second,
            cached_token_cost: shape.cached,
            context_cost: shape.context,
        })
    }

    /// Takes one scrape's counters. A counter that went back is a restarted replica: its
    /// figures so far stay (the same model on the same hardware), the new baseline is
    /// taken from here. A value that is not a finite number teaches nothing. `at` is when
    /// the scrape was read; `quiet`, whether this scrape and the one before it found at
    /// most one request running or waiting, and this one none: a sample of one request
    /// then ran alone, and teaches the shape.
    pub fn observe(&mut self, now: PrefillCounters, at: Instant, quiet: bool) {
        let finite = [
            now.requests,
            now.seconds,
            now.computed_tokens,
            now.prompt_tokens,
        ]
        .iter()
        .all(|v| v.is_finite());
        if !finite {
            return;
        }
        let last = self.last.replace(now);
        let Some(last) = last else { return };
        let n = now.requests - last.requests;
        let t = now.seconds - last.seconds;
        let k = now.computed_tokens - last.computed_tokens;
        let cached = (now.prompt_tokens - last.prompt_tokens - k).max(0.0);
        if n <= 0.0 || t < 0.0 || k < 0.0 {
            return;
        }
        let x = features(n, k, cached);
        if self
            .sampled_at
            .is_some_and(|last| at.saturating_duration_since(last) >= CURRENT_FOR)
        {
            // The first sample after a gap: what came before describes the replica as it
            // was (a replica replaced by a faster one at the same address kept a slow
            // one's fixed cost, and its fit made up for it with a speed 15% too high).
            self.before_gap = self.measured();
            self.sums = Sums::default();
            self.requests = 0.0;
            self.tokens = 0.0;
            self.per_request = None;
            // The speed requests alone showed goes the same way; the shape stays.
            self.alone.clear();
            self.alone_fit = None;
        }
        let t = match self.expected_seconds(&x) {
            Some(expected) if expected > 0.0 => t.clamp(
                expected / MAX_SAMPLE_SURPRISE,
                expected * MAX_SAMPLE_SURPRISE,
            ),
            _ => t,
        };
        self.sums.decay_and_add(x, t);
        self.samples += 1;
        self.sampled_at = Some(at);
        self.requests += n;
        self.tokens += k + Shape::DEFAULT.cached * cached;
        let alone = quiet && n == 1.0 && self.fixed_shape.is_none();
        let ran_alone = alone
            && self
                .alone_fit
                .is_none_or(|fit| t <= fit.seconds(&x) * MAX_ALONE_SURPRISE);
        if !alone {
            self.alone_rejected = 0;
        } else if !ran_alone {
            self.alone_rejected += 1;
            if self.alone_rejected > MAX_ALONE_REJECTED {
                self.alone.clear();
                self.alone_fit = None;
                self.alone_rejected = 0;
            }
        }
        if ran_alone {
            self.alone_rejected = 0;
            self.alone.push_back(AloneSample { x, t });
            if self.alone.len() > ALONE_WINDOW {
                self.alone.pop_front();
            }
            if self.alone.len() >= MIN_ALONE_SAMPLES {
                let known = self.shape.unwrap_or(Shape::DEFAULT);
                if let Some(fit) = fit_alone(&self.alone, known) {
                    self.shape = Some(fit.shape);
                    self.alone_fit = Some(fit);
                }
            }
        }
        if let Some(fit) = self.fit() {
            if fit.told_per_request {
                self.per_request = Some(fit.per_request);
            }
        }
        if self.fitted().is_some() {
            self.before_gap = None;
        }
    }

    fn fit(&self) -> Option<Fit> {
        self.sums
            .fit(self.requests, self.tokens, self.per_request, self.shape)
    }

    /// Seconds the fit so far expects a sample of features `x` to take.
    fn expected_seconds(&self, x: &[f64; FEATURES]) -> Option<f64> {
        Some(self.fit()?.seconds(x))
    }

    /// The replica's own speed, once there is enough evidence (since the last gap of
    /// [`CURRENT_FOR`], else from before it).
    pub fn measured(&self) -> Option<PrefillSpeed> {
        self.fitted().or(self.before_gap)
    }

    /// The fit of the samples since the last gap, once they are enough evidence; that of
    /// the requests that ran alone in its place once there is one: a request's prefill as
    /// the replica computes it, whatever else it was computing meanwhile (the queue in
    /// front of a request is the ranking's backlog, not its speed).
    fn fitted(&self) -> Option<PrefillSpeed> {
        let all = self.fit()?;
        let fit = self.alone_fit.unwrap_or(all);
        let finite = [
            fit.per_request,
            fit.per_token,
            fit.shape.cached,
            fit.shape.context,
        ]
        .iter()
        .all(|v| v.is_finite());
        if !finite {
            return None;
        }
        let tokens_per_second =
            (1.0 / fit.per_token).clamp(MIN_TOKENS_PER_SECOND, MAX_TOKENS_PER_SECOND);
        Some(PrefillSpeed {
            tokens_per_second,
            overhead_tokens: fit.per_request * tokens_per_second,
            cached_token_cost: fit.shape.cached,
            context_cost: fit.shape.context,
        })
    }

    /// Scrapes that saw requests finish.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Whether a request finished within [`CURRENT_FOR`] before `now` and the samples
    /// since the last gap are evidence enough.
    pub fn is_current(&self, now: Instant) -> bool {
        self.sampled_at
            .is_some_and(|at| now.saturating_duration_since(at) < CURRENT_FOR)
            && self.fitted().is_some()
    }
}

/// What [`speeds`] knows of one replica.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Measurement {
    /// Its own figures (or a peer daemon's of it), once there is enough evidence.
    pub speed: Option<PrefillSpeed>,
    /// Scrapes that saw its requests finish.
    pub samples: u64,
    /// Whether the figures are [current](SpeedLearner::is_current) (a peer's count as
    /// current until this daemon measures the replica itself, its events' while
    /// [`SpeedLearner::timed`] gives them).
    pub current: bool,
}

/// Where a replica's speed comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpeedSource {
    /// Its own metrics.
    Measured,
    /// The median of the replicas measured lately: it is not measured yet, measured
    /// within 10% of that median, or no request finished there lately ([`CURRENT_FOR`]).
    Fleet,
    /// What a peer daemon measured of it, taken when this daemon started: it has not
    /// measured the replica itself yet.
    Peer,
    /// Its own KV events (the prefill its picks' last blocks confirmed over the time it was
    /// busy with them): its metrics have measured nothing yet.
    Events,
    /// Nothing measured anywhere: [`PrefillSpeed::DEFAULT`].
    Default,
    /// `--prefill-tokens-per-second` and `--request-overhead-tokens` given (the costs of
    /// cached tokens and context are still measured, unless `--cached-token-cost` is given
    /// too).
    Flags,
}

/// The speed to rank a replica at, `tokens_per_second` by what it measured or was
/// assumed, while its events say it has not finished `overdue`: no faster than that work
/// over that time, once both are evidence enough (as for a busy period its events timed).
/// A bound within [`SAME_SPEED`] of the figure leaves it (the hops to the replica are in
/// the time), and one more than [`MAX_SAMPLE_SURPRISE`] times below it is not taken: a
/// pick awaited that long more likely belongs to a request that failed before its
/// prefill. `None` when no cap can come of this wait as it stands (too little work, or
/// past that bound): the bound falls with time otherwise, so the caller looks again.
pub fn capped_by_overdue(tokens_per_second: f64, overdue: Overdue) -> Option<f64> {
    let Overdue { work, seconds } = overdue;
    if work < MIN_COMPUTED_TOKENS {
        return None;
    }
    if seconds < MIN_TIMED_SECONDS {
        return Some(tokens_per_second);
    }
    let bound = work / seconds;
    if bound * MAX_SAMPLE_SURPRISE < tokens_per_second {
        return None;
    }
    Some(if bound >= tokens_per_second * (1.0 - SAME_SPEED) {
        tokens_per_second
    } else {
        bound
    })
}

/// A replica's speed as the ranking uses it, as `/v1/endpoints` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SpeedView {
    /// Computed prompt tokens prefilled per second.
    pub tokens_per_second: f64,
    /// A request's fixed prefill cost, in milliseconds.
    pub overhead_ms: f64,
    /// What a cached prompt token costs against a computed one.
    pub cached_token_cost: f64,
    /// What a computed token costs more, against its own cost, per token of context before
    /// it.
    pub context_cost: f64,
    /// Where the figures come from.
    pub source: SpeedSource,
    /// What its own metrics measured, once they are enough to go by.
    pub measured_tokens_per_second: Option<f64>,
    /// The fixed cost they measured, in milliseconds.
    pub measured_overhead_ms: Option<f64>,
    /// The cost of a cached token they measured (or assumed, until its requests told it
    /// apart).
    pub measured_cached_token_cost: Option<f64>,
    /// The cost of context they measured (or assumed, as above).
    pub measured_context_cost: Option<f64>,
    /// Scrapes that saw its requests finish.
    pub samples: u64,
}

impl Default for SpeedView {
    fn default() -> Self {
        let default = PrefillSpeed::DEFAULT;
        Self {
            tokens_per_second: default.tokens_per_second,
            overhead_ms: default.overhead_tokens / default.tokens_per_second * 1e3,
            cached_token_cost: default.cached_token_cost,
            context_cost: default.context_cost,
            source: SpeedSource::Default,
            measured_tokens_per_second: None,
            measured_overhead_ms: None,
            measured_cached_token_cost: None,
            measured_context_cost: None,
            samples: 0,
        }
    }
}

impl SpeedView {
    /// The figures the ranking weighs with.
    pub fn speed(&self) -> PrefillSpeed {
        PrefillSpeed {
            tokens_per_second: self.tokens_per_second,
            overhead_tokens: self.overhead_ms / 1e3 * self.tokens_per_second,
            cached_token_cost: self.cached_token_cost,
            context_cost: self.context_cost,
        }
    }
}

/// Operator overrides: a flag given fixes that figure for every replica.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpeedFlags {
    /// `--prefill-tokens-per-second`.
    pub tokens_per_second: Option<f64>,
    /// `--request-overhead-tokens`.
    pub overhead_tokens: Option<f64>,
    /// `--cached-token-cost`: the linear model, a cached token at this share of a computed
    /// one and no cost of context.
    pub cached_token_cost: Option<f64>,
}

/// Replicas whose measured speed is within this fraction of the fleet's median are ranked
/// at the median: a fleet of one model on one kind of hardware then ranks with exactly
/// equal speeds (requests nothing else tells apart take turns, as they did before speeds
/// were measured) instead of sending every new prompt to whichever replica measured a
/// percent faster. A replica 2x slower stays apart.
const SAME_SPEED: f64 = 0.1;

/// Every replica's speed, from what each measured: its own figures once it has enough
/// evidence, they are current and they stand apart from the fleet's median; the median
/// where they do not, or where it has no evidence yet (a replica that joins a measured
/// fleet is ranked as its peers until it has served some requests, so it is not starved);
/// else the default. The median is of the current figures (of all, when none is). A flag
/// overrides its figure everywhere.
pub fn speeds(measured: &[Measurement], flags: SpeedFlags) -> Vec<SpeedView> {
    let median = |mut values: Vec<f64>| -> Option<f64> {
        values.sort_by(f64::total_cmp);
        let mid = values.len() / 2;
        match values.len() {
            0 => None,
            n if n % 2 == 1 => values.get(mid).copied(),
            _ => Some((values.get(mid - 1)? + values.get(mid)?) / 2.0),
        }
    };
    let any_current = measured.iter().any(|m| m.current && m.speed.is_some());
    let known: Vec<PrefillSpeed> = measured
        .iter()
        .filter(|m| m.current || !any_current)
        .filter_map(|m| m.speed)
        .collect();
    let fleet = median(known.iter().map(|s| s.tokens_per_second).collect()).and_then(|rate| {
        let overhead_seconds = median(
            known
                .iter()
                .map(|s| s.overhead_tokens / s.tokens_per_second)
                .collect(),
        )?;
        Some(PrefillSpeed {
            tokens_per_second: rate,
            overhead_tokens: overhead_seconds * rate,
            cached_token_cost: median(known.iter().map(|s| s.cached_token_cost).collect())?,
            context_cost: median(known.iter().map(|s| s.context_cost).collect())?,
        })
    });
    measured
        .iter()
        .map(
            |&Measurement {
                 speed: own,
                 samples,
                 current,
             }| {
                let (speed, source) = match (own, fleet) {
                    (Some(own), Some(fleet))
                        if !current
                            || (own.tokens_per_second / fleet.tokens_per_second - 1.0).abs()
                                <= SAME_SPEED =>
                    {
                        (fleet, SpeedSource::Fleet)
                    }
                    (Some(own), _) => (own, SpeedSource::Measured),
                    (None, Some(fleet)) => (fleet, SpeedSource::Fleet),
                    (None, None) => (PrefillSpeed::DEFAULT, SpeedSource::Default),
                };
                let tokens_per_second = flags.tokens_per_second.unwrap_or(speed.tokens_per_second);
                let overhead_tokens = match (flags.overhead_tokens, flags.tokens_per_second) {
                    (Some(tokens), _) => tokens,
                    // A fixed rate keeps a measured overhead in seconds; with nothing measured
                    // the overhead stays the default's 200 tokens, as it was with that flag.
                    (None, Some(rate)) if source != SpeedSource::Default => {
                        speed.overhead_tokens / speed.tokens_per_second * rate
                    }
                    (None, _) => speed.overhead_tokens,
                };
                let (cached_token_cost, context_cost) = match flags.cached_token_cost {
                    Some(cost) => (cost, 0.0),
                    None => (speed.cached_token_cost, speed.context_cost),
                };
                let flagged = flags.tokens_per_second.is_some() && flags.overhead_tokens.is_some();
                SpeedView {
                    tokens_per_second,
                    overhead_ms: overhead_tokens / tokens_per_second * 1e3,
                    cached_token_cost,
                    context_cost,
                    source: if flagged { SpeedSource::Flags } else { source },
                    measured_tokens_per_second: own.map(|s| s.tokens_per_second),
                    measured_overhead_ms: own
                        .map(|s| s.overhead_tokens / s.tokens_per_second * 1e3),
                    measured_cached_token_cost: own.map(|s| s.cached_token_cost),
                    measured_context_cost: own.map(|s| s.context_cost),
                    samples,
                }
            },
        )
        .collect()
}

/// How a replica is ranked before anything is measured anywhere: the default, or the
/// operator's flags.
pub fn unmeasured(flags: SpeedFlags) -> SpeedView {
    speeds(&[Measurement::default()], flags)
        .first()
        .copied()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(requests: f64, seconds: f64, computed_tokens: f64) -> PrefillCounters {
        PrefillCounters {
            requests,
            seconds,
            computed_tokens,
            prompt_tokens: computed_tokens,
        }
    }

    /// A replica's figures with a request finished there lately.
    fn current(speed: Option<PrefillSpeed>, samples: u64) -> Measurement {
        Measurement {
            speed,
            samples,
            current: true,
        }
    }

    /// Feeds scrapes of requests that each take `overhead + tokens / rate`.
    fn feed(learner: &mut SpeedLearner, sizes: &[(f64, f64)], overhead: f64, rate: f64) {
        let mut total = learner.last.unwrap_or_default();
        learner.observe(total, Instant::now(), false);
        for &(n, tokens) in sizes {
            total.requests += n;
            total.computed_tokens += n * tokens;
            total.prompt_tokens += n * tokens;
            total.seconds += n * (overhead + tokens / rate);
            learner.observe(total, Instant::now(), false);
        }
    }

    #[test]
    fn speed_and_overhead_are_told_apart_by_requests_of_different_sizes() {
        let mut learner = SpeedLearner::default();
        feed(
            &mut learner,
            &[
                (1.0, 6000.0),
                (1.0, 64.0),
                (2.0, 1500.0),
                (1.0, 6000.0),
                (3.0, 100.0),
            ],
            0.04,
            8000.0,
        );
        let speed = learner.measured().unwrap();
        assert!((speed.tokens_per_second - 8000.0).abs() < 1e-6, "{speed:?}");
        assert!((speed.overhead_tokens - 320.0).abs() < 1e-6, "{speed:?}");
        assert_eq!(learner.samples(), 5);
    }

    #[test]
    fn requests_of_one_shape_keep_the_fixed_cost_learned_from_requests_of_many() {
        let mut learner = SpeedLearner::default();
        let mixed = [(1.0, 6000.0), (1.0, 64.0), (2.0, 1500.0), (3.0, 100.0)];
        feed(&mut learner, &mixed, 0.04, 8000.0);
        // A hundred scrapes of one size, long enough for the mixed ones to decay away:
        // the plain ratio would give 300 tokens in 77.5 ms, 3,871 tokens/s and no fixed
        // cost.
        feed(&mut learner, &[(2.0, 300.0); 100], 0.04, 8000.0);
        let speed = learner.measured().unwrap();
        assert!((speed.tokens_per_second - 8000.0).abs() < 1.0, "{speed:?}");
        assert!((speed.overhead_tokens - 320.0).abs() < 0.1, "{speed:?}");
        // The replica slows down meanwhile: what is left after the fixed cost is its speed
        // (within 1%: the faster scrapes have not quite decayed away).
        feed(&mut learner, &[(2.0, 300.0); 100], 0.04, 4000.0);
        let speed = learner.measured().unwrap();
        assert!(
            (speed.tokens_per_second / 4000.0 - 1.0).abs() < 0.01,
            "{speed:?}"
        );
    }

    #[test]
    fn a_stall_mid_prefill_bends_the_fit_and_a_real_slowdown_moves_it() {
        let mut learner = SpeedLearner::default();
        let steady = [(1.0, 1000.0); 30];
        feed(&mut learner, &steady, 0.0, 4000.0);
        // One request of 1,000 tokens caught by an 80 s stall: 320 times what it costs.
        let mut stalled = learner.last.unwrap_or_default();
        stalled.requests += 1.0;
        stalled.computed_tokens += 1000.0;
        stalled.prompt_tokens += 1000.0;
        stalled.seconds += 80.0;
        learner.observe(stalled, Instant::now(), false);
        let after_stall = learner.measured().unwrap().tokens_per_second;
        assert!(after_stall > 4000.0 / 2.0, "{after_stall}");
        // The replica really became ten times slower: followed within 10%.
        feed(&mut learner, &[(1.0, 1000.0); 100], 0.0, 400.0);
        let slowed = learner.measured().unwrap().tokens_per_second;
        assert!((slowed / 400.0 - 1.0).abs() < 0.1, "{slowed}");
    }

    #[test]
    fn cached_tokens_cost_what_the_ranking_says_and_no_more() {
        // 6,000-token continuations of which 5,800 are cached, beside 2,000-token cold
        // prompts, on a replica that prefills 10,000 tokens/s after 40 ms and attends over
        // a cached token at a tenth of the cost.
        let mut learner = SpeedLearner::default();
        let mut total = PrefillCounters::default();
        learner.observe(total, Instant::now(), false);
        for (computed, prompt) in [
            (200.0, 6000.0),
            (2000.0, 2000.0),
            (200.0, 6000.0),
            (2000.0, 2000.0),
        ] {
            total.requests += 1.0;
            total.computed_tokens += computed;
            total.prompt_tokens += prompt;
            total.seconds += 0.04 + (computed + 0.1 * (prompt - computed)) / 10_000.0;
            learner.observe(total, Instant::now(), false);
        }
        let speed = learner.measured().unwrap();
        assert!(
            (speed.tokens_per_second - 10_000.0).abs() < 1e-6,
            "{speed:?}"
        );
        assert!((speed.overhead_tokens - 400.0).abs() < 1e-6, "{speed:?}");
    }

    /// Feeds one scrape per request of `(computed, cached)` tokens, each taking `seconds`
    /// of them.
    fn feed_shapes(
        learner: &mut SpeedLearner,
        requests: &[(f64, f64)],
        seconds: impl Fn(f64, f64) -> f64,
    ) {
        learner.observe(learner.last.unwrap_or_default(), Instant::now(), false);
        feed_scrapes(
            learner,
            requests.iter().copied(),
            seconds,
            Instant::now(),
            |_| true,
        );
    }

    /// Feeds one scrape read at `at` per request of `(computed, cached)` tokens after the
    /// learner's last counters, the i-th quiet if `quiet(i)`.
    fn feed_scrapes(
        learner: &mut SpeedLearner,
        requests: impl IntoIterator<Item = (f64, f64)>,
        seconds: impl Fn(f64, f64) -> f64,
        at: Instant,
        quiet: impl Fn(usize) -> bool,
    ) {
        let mut total = learner.last.unwrap_or_default();
        for (i, (computed, cached)) in requests.into_iter().enumerate() {
            total.requests += 1.0;
            total.computed_tokens += computed;
            total.prompt_tokens += computed + cached;
            total.seconds += seconds(computed, cached);
            learner.observe(total, at, quiet(i));
        }
    }

    /// Cold prompts and continuations of several sizes, as a chat fleet sends them.
    const CHAT: [(f64, f64); 8] = [
        (1024.0, 0.0),
        (7168.0, 0.0),
        (32.0, 7168.0),
        (320.0, 1024.0),
        (2560.0, 7168.0),
        (4096.0, 0.0),
        (128.0, 7168.0),
        (1280.0, 1024.0),
    ];

    /// The large benchmark model on real vLLM 0.32.0 (`bench prefill-shape`, 2026-12-07
    /// 16:16 UTC): 21.3 ms, then 0.174 ms per computed token and 87.86 ns per token of
    /// context it attends over.
    const LARGE: (f64, f64, f64) = (0.0213, 0.174e-3, 87.86e-9);

    /// Seconds the large model takes to prefill `k` computed tokens after `c` cached.
    fn large(k: f64, c: f64) -> f64 {
        let (a, b, e) = LARGE;
        a + b * k + e * k * (c + k / 2.0)
    }

    /// A learner that has seen [`CHAT`]'s requests alone on the large model, and what it
    /// learned.
    fn learned_large() -> (SpeedLearner, PrefillSpeed) {
        let mut learner = SpeedLearner::default();
        feed_shapes(&mut learner, &CHAT, large);
        let learned = learner.measured().unwrap();
        (learner, learned)
    }

    #[test]
    fn a_replica_that_pays_for_context_is_learned_as_one() {
        let (a, b, e) = LARGE;
        let (mut learner, speed) = learned_large();
        assert!(
            (speed.tokens_per_second * b - 1.0).abs() < 1e-6,
            "{speed:?}"
        );
        assert!((speed.overhead_tokens - a / b).abs() < 1e-3, "{speed:?}");
        assert!((speed.context_cost - e / b).abs() < 1e-9, "{speed:?}");
        assert!(speed.cached_token_cost.abs() < 1e-6, "{speed:?}");
        // A hot prompt's requests, all of one shape, keep that shape.
        feed_shapes(&mut learner, &[(128.0, 7168.0); 100], large);
        let kept = learner.measured().unwrap();
        assert!(
            (kept.context_cost / speed.context_cost - 1.0).abs() < 1e-3,
            "{kept:?}"
        );
        assert!((kept.tokens_per_second / speed.tokens_per_second - 1.0).abs() < 1e-3);
    }

    #[test]
    fn a_hot_prompts_noisy_requests_keep_the_shape_within_reason() {
        let (mut learner, learned) = learned_large();
        // A hot prompt's requests alone: 7,168 cached tokens, 120 to 135 new ones, each
        // taking its time within 10% either way, long enough for the requests of other
        // shapes to leave the window.
        let requests = (0..100).map(|i| (120.0 + f64::from(i % 16), 7168.0));
        let noise = |k: f64| 1.0 + 0.1 * (k * 1.7).sin();
        feed_scrapes(
            &mut learner,
            requests,
            |k, c| large(k, c) * noise(k),
            Instant::now(),
            |_| true,
        );
        let kept = learner.measured().unwrap();
        // What a cold prefill of 4,096 tokens and a continuation of 2,560 after 7,168
        // cost by the shape learned from requests of many shapes and by the one kept.
        for (k, c) in [(4096.0, 0.0), (2560.0, 7168.0)] {
            let ratio = kept.request_seconds(k, c) / learned.request_seconds(k, c);
            assert!(
                (0.75..1.25).contains(&ratio),
                "{ratio} {kept:?} {learned:?}"
            );
        }
    }

    #[test]
    fn each_sample_is_predicted_from_the_others_as_refitting_without_it_does() {
        let noise = |k: f64| 1.0 + 0.1 * (k * 1.7).sin();
        let samples: Vec<(AloneSample, f64)> = CHAT
            .iter()
            .chain(&CHAT)
            .enumerate()
            .map(|(i, &(k, c))| {
                let sample = AloneSample {
                    x: features(1.0, k, c),
                    t: large(k, c) * noise(k + c),
                };
                (sample, DECAY.powi(i32::try_from(i).unwrap_or(0)))
            })
            .collect();
        let mut sums = Sums::default();
        for (sample, weight) in &samples {
            sums.add(sample.x, sample.t, *weight, 1.0);
        }
        let columns = Columns::new(Hold::Fitted, Hold::Fitted, Shape::DEFAULT);
        let solved = columns.solve(&sums).unwrap();
        let refitted: f64 = samples
            .iter()
            .map(|(sample, weight)| {
                let mut others = sums;
                others.add(sample.x, sample.t, -weight, 1.0);
                let without = columns.solve(&others).unwrap();
                let predicted: f64 = columns
                    .values(&sample.x)
                    .iter()
                    .zip(&without.coefficients)
                    .map(|(v, c)| v * c)
                    .sum();
                weight * (sample.t - predicted).powi(2)
            })
            .sum();
        let closed = columns.left_out_error(&solved, &samples);
        assert!(
            (closed / refitted - 1.0).abs() < 1e-6,
            "{closed} {refitted}"
        );
    }

    #[test]
    fn a_cost_one_request_alone_shows_is_held_at_what_was_known() {
        // Cold prompts of five sizes, then one continuation: the only request with cached
        // tokens decides their cost alone, so it is not fitted (nor taken to be zero).
        let mut learner = SpeedLearner::default();
        feed_shapes(
            &mut learner,
            &[
                (512.0, 0.0),
                (1024.0, 0.0),
                (2048.0, 0.0),
                (4096.0, 0.0),
                (768.0, 0.0),
                (3072.0, 0.0),
                (320.0, 4096.0),
            ],
            large,
        );
        let speed = learner.measured().unwrap();
        assert_eq!(speed.cached_token_cost, Shape::DEFAULT.cached, "{speed:?}");
        assert!(speed.context_cost > 0.0, "{speed:?}");
    }

    #[test]
    fn requests_that_shared_the_engine_teach_no_shape() {
        let (mut learner, learned) = learned_large();
        // Bursts of three: each request's prefill twice as long as alone and 100 ms more
        // (the batches it shared), the scrapes seeing others running (not quiet) but for
        // each burst's last, which passes the scrapes' test of alone with a time as shared
        // as the rest (every one of the eight shapes among them).
        feed_scrapes(
            &mut learner,
            CHAT.iter().copied().cycle().take(90),
            |k, c| 0.1 + 2.0 * large(k, c),
            Instant::now(),
            |i| i % 3 == 2,
        );
        let burst = learner.measured().unwrap();
        assert_eq!(
            (burst.cached_token_cost, burst.context_cost),
            (learned.cached_token_cost, learned.context_cost),
            "{burst:?}"
        );
        // The speed and the fixed cost stay what requests alone showed: the burst's wait
        // is the backlog's to count.
        assert_eq!(burst, learned);
        assert!(
            (burst.seconds(burst.overhead_tokens) - LARGE.0).abs() < 1e-9,
            "{burst:?}"
        );
    }

    #[test]
    fn a_replica_that_got_slower_is_followed_by_its_requests_alone() {
        let (mut learner, before) = learned_large();
        // Twice as slow from now on, every request alone: the first few are taken for
        // shared ones, then the fit starts afresh and learns the new speed.
        feed_shapes(&mut learner, &CHAT, |k, c| 2.0 * large(k, c));
        feed_shapes(&mut learner, &CHAT, |k, c| 2.0 * large(k, c));
        let after = learner.measured().unwrap();
        assert!(
            (after.tokens_per_second * 2.0 / before.tokens_per_second - 1.0).abs() < 1e-6,
            "{before:?} then {after:?}"
        );
        assert!((after.context_cost / before.context_cost - 1.0).abs() < 1e-6);
    }

    /// Requests alone on a real vLLM 0.24.0 replica of the e2e pair (the check
    /// `kvaffined_learns_what_context_costs_the_replica`): cached tokens, computed tokens and
    /// vLLM's prefill seconds, in the order they were sent.
    type Measured = [(f64, f64, f64); 10];

    /// A fresh replica: its first request paid for vLLM's warm-up (2026-12-08 00:20 UTC).
    const FRESH_0_24: Measured = [
        (0.0, 512.0, 0.1162),
        (0.0, 1024.0, 0.0298),
        (0.0, 2048.0, 0.0705),
        (0.0, 4096.0, 0.1584),
        (1024.0, 32.0, 0.0142),
        (1024.0, 320.0, 0.0213),
        (1024.0, 1280.0, 0.0517),
        (4096.0, 32.0, 0.0160),
        (4096.0, 320.0, 0.0394),
        (4096.0, 1280.0, 0.1205),
    ];

    /// A replica that had served the suite's earlier checks (2026-12-07 23:47 UTC).
    const SERVED_0_24: Measured = [
        (0.0, 512.0, 0.0264),
        (0.0, 1024.0, 0.0379),
        (0.0, 2048.0, 0.0628),
        (0.0, 4096.0, 0.1756),
        (1024.0, 32.0, 0.0153),
        (1024.0, 320.0, 0.0269),
        (1024.0, 1280.0, 0.0512),
        (4096.0, 32.0, 0.0148),
        (4096.0, 320.0, 0.0405),
        (4096.0, 1280.0, 0.0942),
    ];

    /// What a learner fed `measured`'s requests alone learned, and the median of how far
    /// off it prices them.
    fn learned_from(measured: &Measured) -> (PrefillSpeed, f64) {
        let mut learner = SpeedLearner::default();
        let requests: Vec<(f64, f64)> = measured.iter().map(|&(c, k, _)| (k, c)).collect();
        // Each shape was sent once.
        let seconds = |k, c| {
            measured
                .iter()
                .find(|&&(cached, computed, _)| (cached, computed) == (c, k))
                .map_or(f64::NAN, |&(_, _, t)| t)
        };
        learner.observe(PrefillCounters::default(), Instant::now(), false);
        feed_scrapes(&mut learner, requests, seconds, Instant::now(), |_| true);
        let speed = learner.measured().unwrap();
        let mut errors: Vec<f64> = measured
            .iter()
            .map(|&(c, k, t)| (speed.request_seconds(k, c) / t - 1.0).abs())
            .collect();
        errors.sort_by(f64::total_cmp);
        (speed, errors[errors.len() / 2])
    }

    #[test]
    fn a_first_request_that_paid_for_warm_up_is_left_out() {
        let (speed, error) = learned_from(&FRESH_0_24);
        let (cached, computed, took) = FRESH_0_24[0];
        assert!(
            speed.request_seconds(computed, cached) < took / 2.0,
            "{speed:?}"
        );
        assert!(speed.context_cost > 0.0, "{speed:?}");
        assert!(error < 0.15, "{error} {speed:?}");
    }

    #[test]
    fn the_requests_alone_of_a_real_replica_are_priced_within_15_percent() {
        let (speed, error) = learned_from(&SERVED_0_24);
        assert!(speed.context_cost > 0.0, "{speed:?}");
        assert!(error < 0.15, "{error} {speed:?}");
    }

    #[test]
    fn the_flag_fits_the_linear_model_as_before() {
        let mut learner = SpeedLearner::new(Some(0.1));
        feed_shapes(&mut learner, &CHAT, large);
        let speed = learner.measured().unwrap();
        assert_eq!((speed.cached_token_cost, speed.context_cost), (0.1, 0.0));
        // The speed is the linear model's fit to every request: far below the computed
        // tokens' own 5,747 tokens/s, the context folded in.
        assert!(speed.tokens_per_second < 4000.0, "{speed:?}");
    }

    #[test]
    fn the_shape_outlasts_a_quiet_spell() {
        let (mut learner, learned) = learned_large();
        let learned = learned.context_cost;
        // After a quiet spell, requests of one shape: the rest is fitted afresh, the shape
        // stays.
        let later = Instant::now() + CURRENT_FOR * 2;
        feed_scrapes(&mut learner, [(128.0, 7168.0); 4], large, later, |_| false);
        assert!(learner.is_current(later));
        let after = learner.measured().unwrap();
        assert_eq!(after.context_cost, learned, "{after:?}");
    }

    #[test]
    fn a_replica_that_pays_per_cached_token_is_learned_as_one() {
        // The emulator's calibration to a GPT-OSS-20B GPU: 40 ms, 0.1955 ms per computed and
        // 0.0186 ms per cached token, nothing for context. Its scheduler rounds to a
        // microsecond.
        let mut learner = SpeedLearner::default();
        feed_shapes(&mut learner, &CHAT, |k, c| {
            ((0.040 + 0.1955e-3 * k + 0.0186e-3 * c) * 1e6).round() / 1e6
        });
        let speed = learner.measured().unwrap();
        assert!(
            (speed.tokens_per_second / 5115.1 - 1.0).abs() < 1e-3,
            "{speed:?}"
        );
        assert!(
            (speed.cached_token_cost / 0.09514 - 1.0).abs() < 1e-2,
            "{speed:?}"
        );
        assert!(speed.context_cost < 1e-8, "{speed:?}");
    }

    #[test]
    fn a_value_that_is_not_a_number_teaches_nothing() {
        let mut learner = SpeedLearner::default();
        feed(&mut learner, &[(1.0, 4000.0); 3], 0.0, 4000.0);
        let before = learner.measured();
        let mut bad = learner.last.unwrap();
        bad.seconds = f64::NAN;
        learner.observe(bad, Instant::now(), false);
        bad.seconds = f64::INFINITY;
        learner.observe(bad, Instant::now(), false);
        assert_eq!(learner.measured(), before);
        assert!(before.is_some_and(|s| s.tokens_per_second.is_finite()));
    }

    #[test]
    fn requests_of_one_size_give_the_plain_ratio() {
        let mut learner = SpeedLearner::default();
        feed(&mut learner, &[(1.0, 4000.0); 4], 0.1, 10_000.0);
        let speed = learner.measured().unwrap();
        // 0.5 s per 4,000 tokens, the overhead folded in.
        assert!((speed.tokens_per_second - 8000.0).abs() < 1e-6, "{speed:?}");
        assert_eq!(speed.overhead_tokens, 0.0);
    }

    #[test]
    fn too_little_evidence_measures_nothing() {
        let mut learner = SpeedLearner::default();
        learner.observe(counters(0.0, 0.0, 0.0), Instant::now(), false);
        assert_eq!(learner.measured(), None);
        // Two probes of a few tokens are no measure of a replica that takes time.
        learner.observe(counters(1.0, 0.04, 10.0), Instant::now(), false);
        learner.observe(counters(2.0, 0.08, 20.0), Instant::now(), false);
        assert_eq!(learner.measured(), None);
        learner.observe(counters(3.0, 0.5, 4020.0), Instant::now(), false);
        assert!(learner.measured().is_some());
    }

    #[test]
    fn an_overdue_pick_caps_the_speed_within_reason() {
        let overdue = |work: f64, seconds: f64| Overdue { work, seconds };
        // 3,000 tokens not done in a second: no faster than 3,000 tokens/s.
        assert_eq!(
            capped_by_overdue(5000.0, overdue(3000.0, 1.0)),
            Some(3000.0)
        );
        // A bound above the figure, or within a tenth below it, leaves the figure.
        assert_eq!(
            capped_by_overdue(2000.0, overdue(3000.0, 1.0)),
            Some(2000.0)
        );
        assert_eq!(
            capped_by_overdue(3200.0, overdue(3000.0, 1.0)),
            Some(3200.0)
        );
        // Too short a time is no evidence yet; too little work never will be.
        assert_eq!(
            capped_by_overdue(50_000.0, overdue(2048.0, 0.04)),
            Some(50_000.0)
        );
        assert_eq!(capped_by_overdue(5000.0, overdue(1000.0, 1.0)), None);
        // More than eight times below the figure: more likely a lost pick than that slow.
        assert_eq!(capped_by_overdue(5000.0, overdue(3000.0, 4.0)), Some(750.0));
        assert_eq!(capped_by_overdue(5000.0, overdue(3000.0, 5.0)), None);
    }

    #[test]
    fn events_time_a_replica_until_its_metrics_measure_it() {
        let now = Instant::now();
        let mut learner = SpeedLearner::default();
        let confirmed = |work: f64, seconds: f64| Confirmed { work, seconds };
        // Too little work, or too short a busy period (the hops to the replica and back
        // are most of a few milliseconds), times nothing.
        assert!(!learner.observe_confirmed(confirmed(1000.0, 0.5), now));
        assert!(!learner.observe_confirmed(confirmed(8000.0, 0.002), now));
        assert_eq!(learner.timed(now), None);
        assert!(learner.observe_confirmed(confirmed(3700.0, 1.0), now));
        let timed = learner.timed(now).unwrap();
        assert!((timed.tokens_per_second - 3700.0).abs() < 1e-9, "{timed:?}");
        // The default's fixed cost in seconds: 40 ms.
        assert!((timed.overhead_tokens - 148.0).abs() < 1e-9, "{timed:?}");
        // It stands for as long as a measured figure is current.
        assert!(learner.timed(now + CURRENT_FOR / 2).is_some());
        assert_eq!(learner.timed(now + CURRENT_FOR), None);
        // Once the metrics are evidence enough, they rank it and the events no longer do.
        feed(
            &mut learner,
            &[(1.0, 4000.0), (1.0, 1000.0), (1.0, 3000.0)],
            0.0,
            5000.0,
        );
        assert!(learner.measured().is_some());
        assert_eq!(learner.timed(now), None);
        assert!(!learner.observe_confirmed(confirmed(3700.0, 1.0), now));
    }

    #[test]
    fn two_requests_in_two_scrapes_are_evidence_enough() {
        let mut learner = SpeedLearner::default();
        learner.observe(counters(0.0, 0.0, 0.0), Instant::now(), false);
        learner.observe(counters(1.0, 0.02, 25.0), Instant::now(), false);
        learner.observe(counters(2.0, 0.5, 2125.0), Instant::now(), false);
        assert!(learner.measured().is_some());
    }

    #[test]
    fn a_restart_takes_a_new_baseline_and_keeps_what_was_learned() {
        let mut learner = SpeedLearner::default();
        feed(&mut learner, &[(1.0, 4000.0); 3], 0.0, 4000.0);
        let before = learner.measured().unwrap();
        learner.observe(counters(1.0, 0.01, 5.0), Instant::now(), false);
        assert_eq!(learner.measured(), Some(before));
        // The first sample after the restart counts from the new baseline.
        learner.observe(counters(2.0, 1.01, 4005.0), Instant::now(), false);
        assert_eq!(learner.samples(), 4);
    }

    #[test]
    fn an_instant_replica_is_fast_not_infinite() {
        let mut learner = SpeedLearner::default();
        feed(&mut learner, &[(2.0, 3000.0); 2], 0.0, f64::INFINITY);
        let speed = learner.measured().unwrap();
        assert_eq!(speed.tokens_per_second, MAX_TOKENS_PER_SECOND);
        assert!(speed.seconds(1e6).is_finite());
        // Tens of microseconds of scheduling noise are no speed either: two such replicas
        // rank alike however the noise fell.
        let noisy = |jitter: f64| {
            let mut learner = SpeedLearner::default();
            let mut total = PrefillCounters::default();
            learner.observe(total, Instant::now(), false);
            for (i, tokens) in [64.0, 3000.0, 128.0, 2000.0].into_iter().enumerate() {
                total.requests += 1.0;
                total.computed_tokens += tokens;
                total.prompt_tokens += tokens;
                total.seconds += 20e-6 + jitter * (i % 2) as f64;
                learner.observe(total, Instant::now(), false);
            }
            learner.measured().unwrap()
        };
        assert_eq!(noisy(10e-6), noisy(300e-6));
        assert_eq!(noisy(10e-6).overhead_tokens, 0.0);
    }

    #[test]
    fn unmeasured_replicas_take_the_fleets_median_and_flags_override() {
        let speed = |tokens_per_second: f64, overhead_ms: f64| PrefillSpeed {
            tokens_per_second,
            overhead_tokens: overhead_ms / 1e3 * tokens_per_second,
            ..PrefillSpeed::DEFAULT
        };
        let (fast, slow) = (speed(20_000.0, 20.0), speed(10_000.0, 40.0));
        let views = speeds(
            &[
                current(Some(fast), 9),
                current(None, 0),
                current(Some(slow), 3),
            ],
            SpeedFlags::default(),
        );
        let sources: Vec<SpeedSource> = views.iter().map(|v| v.source).collect();
        assert_eq!(
            sources,
            [
                SpeedSource::Measured,
                SpeedSource::Fleet,
                SpeedSource::Measured
            ]
        );
        assert_eq!(views[1].tokens_per_second, 15_000.0);
        assert!(
            (views[1].overhead_ms - 30.0).abs() < 1e-9,
            "the median of 20 and 40 ms"
        );
        assert_eq!(views[0].speed(), fast);
        assert_eq!(views[1].measured_tokens_per_second, None);
        let views = speeds(&[current(None, 0)], SpeedFlags::default());
        assert_eq!(views[0].source, SpeedSource::Default);
        assert_eq!(views[0].speed(), PrefillSpeed::DEFAULT);
        let flags = SpeedFlags {
            tokens_per_second: Some(40_000.0),
            ..SpeedFlags::default()
        };
        let attending = PrefillSpeed {
            cached_token_cost: 0.0,
            context_cost: 5e-4,
            ..fast
        };
        let linear = SpeedFlags {
            cached_token_cost: Some(0.2),
            ..SpeedFlags::default()
        };
        let view = speeds(&[current(Some(attending), 9)], linear)[0];
        assert_eq!((view.cached_token_cost, view.context_cost), (0.2, 0.0));
        assert_eq!(view.measured_context_cost, Some(5e-4));
        let views = speeds(&[current(Some(fast), 9)], flags);
        assert_eq!(views[0].tokens_per_second, 40_000.0);
        assert_eq!(views[0].measured_tokens_per_second, Some(20_000.0));
        assert!(
            (views[0].overhead_ms - 20.0).abs() < 1e-9,
            "the measured overhead stays"
        );
        let flags = SpeedFlags {
            tokens_per_second: Some(40_000.0),
            overhead_tokens: Some(200.0),
            ..SpeedFlags::default()
        };
        assert_eq!(
            speeds(&[current(Some(fast), 9)], flags)[0].source,
            SpeedSource::Flags
        );
    }

    #[test]
    fn replicas_measured_close_to_the_fleets_median_rank_at_it() {
        let speed = |tokens_per_second: f64| PrefillSpeed {
            tokens_per_second,
            overhead_tokens: 0.0,
            ..PrefillSpeed::DEFAULT
        };
        let views = speeds(
            &[
                current(Some(speed(41_000.0)), 5),
                current(Some(speed(39_000.0)), 5),
            ],
            SpeedFlags::default(),
        );
        assert_eq!(views[0].speed(), views[1].speed(), "{views:?}");
        assert_eq!(views[0].source, SpeedSource::Fleet);
        assert_eq!(views[0].measured_tokens_per_second, Some(41_000.0));
        // One replica of three at half speed stays apart; the other two rank equal.
        let views = speeds(
            &[
                current(Some(speed(20_000.0)), 5),
                current(Some(speed(10_000.0)), 5),
                current(Some(speed(20_500.0)), 5),
            ],
            SpeedFlags::default(),
        );
        assert_eq!(views[1].tokens_per_second, 10_000.0);
        assert_eq!(views[0].speed(), views[2].speed());
    }

    #[test]
    fn a_figure_no_request_refreshed_lately_ranks_at_the_fleets_current_median() {
        let mut learner = SpeedLearner::default();
        let start = Instant::now();
        assert!(!learner.is_current(start), "nothing sampled yet");
        learner.observe(counters(0.0, 0.0, 0.0), start, false);
        assert!(!learner.is_current(start), "a baseline is no sample");
        learner.observe(counters(1.0, 1.0, 1366.0), start, false);
        learner.observe(counters(2.0, 2.0, 2732.0), start, false);
        assert_eq!(learner.measured().unwrap().tokens_per_second, 1366.0);
        let late = start + CURRENT_FOR;
        assert!(learner.is_current(late - Duration::from_millis(1)));
        assert!(!learner.is_current(late));
        // After the gap the replica got 3x faster: its old figures stand until the new
        // samples are evidence enough (two requests, 2,048 tokens), then only the new
        // ones count.
        learner.observe(counters(3.0, 2.375, 4232.0), late, false);
        assert!(!learner.is_current(late));
        assert_eq!(learner.measured().unwrap().tokens_per_second, 1366.0);
        learner.observe(counters(4.0, 2.75, 5732.0), late, false);
        assert!(learner.is_current(late));
        assert_eq!(learner.measured().unwrap().tokens_per_second, 4000.0);
        // The pair of the real-vLLM failure: one replica measured at 1,366 tokens/s while
        // the host was loaded, then given nothing; its peer at 1,900 and serving.
        let speed = |tokens_per_second: f64| PrefillSpeed {
            tokens_per_second,
            overhead_tokens: 0.0,
            ..PrefillSpeed::DEFAULT
        };
        let (slow, fast) = (speed(1366.0), speed(1900.0));
        let stale = Measurement {
            speed: Some(slow),
            samples: 18,
            current: false,
        };
        let views = speeds(&[stale, current(Some(fast), 40)], SpeedFlags::default());
        assert_eq!(views[0].speed(), fast, "{views:?}");
        assert_eq!(views[0].source, SpeedSource::Fleet);
        assert_eq!(views[0].measured_tokens_per_second, Some(1366.0));
        assert_eq!(views[1].speed(), fast);
        // Current again: apart again.
        let views = speeds(
            &[current(Some(slow), 19), current(Some(fast), 40)],
            SpeedFlags::default(),
        );
        assert_eq!(views[0].speed(), slow);
        assert_eq!(views[0].source, SpeedSource::Measured);
        // A fleet where nothing finished lately ranks at the median of what it measured.
        let idle = |speed| Measurement {
            speed: Some(speed),
            samples: 5,
            current: false,
        };
        let views = speeds(
            &[idle(slow), idle(fast), Measurement::default()],
            SpeedFlags::default(),
        );
        assert!(
            views.iter().all(|v| v.tokens_per_second == 1633.0),
            "{views:?}"
        );
    }
}
