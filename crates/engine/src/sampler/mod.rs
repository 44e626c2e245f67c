//! Next-token sampling (temperature, top-k, top-p, min-p) and logprobs.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use ember_tensor::cpu::{argmax, max_ignoring_nan};

mod params;
mod rng;

pub use params::{Penalties, SamplingError, SamplingParams};
#[cfg(test)]
use rng::splitmix64;
use rng::{Xoshiro256StarStar, entropy_seed};

#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: u32,
    /// Scaled logit, then unnormalised probability.
    value: f32,
}

/// Descending value, then ascending id: a total order, so results never
/// depend on the sort algorithm's handling of ties.
fn by_value_desc(a: &Candidate, b: &Candidate) -> Ordering {
    b.value.total_cmp(&a.value).then(a.id.cmp(&b.id))
}

/// Samples token ids from logits. Holds its RNG and scratch buffers that are
/// reused across calls, so sampling allocates nothing after the first token.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256StarStar,
    candidates: Vec<Candidate>,
    /// Softmax numerators exp((logit - max) / T) over the whole vocabulary.
    probs: Vec<f32>,
    /// Sum of `probs` per block of BLOCK tokens, to find a draw in O(V / BLOCK + BLOCK).
    block_sums: Vec<f32>,
    /// Size-k min-heap for top-k selection.
    heap: BinaryHeap<Reverse<Ranked>>,
}

/// Tokens per entry of `block_sums`.
const BLOCK: usize = 256;
/// Lanes of the explicitly unrolled loops; lets the compiler use wide vectors.
const LANES: usize = 16;
/// Above this top_k, a partial sort beats the heap.
const HEAP_TOP_K_MAX: usize = 1024;
/// Thresholds (relative to the top token) tried when gathering a nucleus.
const TOP_P_PROBES: [f32; 4] = [1e-2, 1e-4, 1e-6, 0.0];

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(entropy_seed);
        Self {
            params,
            rng: Xoshiro256StarStar::seed_from_u64(seed),
            candidates: Vec::new(),
            probs: Vec::new(),
            block_sums: Vec::new(),
            heap: BinaryHeap::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. NaN logits are ignored; empty or all-NaN logits
    /// give 0 rather than a panic.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.is_greedy() {
            return argmax(logits);
        }
        let max = max_ignoring_nan(logits);
        let inv_temperature = 1.0 / p.temperature;
        if !(max * inv_temperature).is_finite() {
            // All -inf/NaN, an infinite logit, or a temperature so small that
            // scaling overflows: the top token owns all the mass.
            return argmax(logits);
        }
        let use_top_p = p.top_p < 1.0;
        // NaN min_p (unvalidated params) counts as off.
        let min_p = if p.min_p > 0.0 { p.min_p.min(1.0) } else { 0.0 };

        if p.top_k > 0 && p.top_k < logits.len() {
            // Softmax over the k survivors only.
            self.gather_top_k(logits, p.top_k);
            let mut sum = 0.0f32;
            for c in self.candidates.iter_mut() {
                c.value = exp_nonpositive((c.value - max) * inv_temperature);
                sum += c.value;
            }
            return self.finish(use_top_p.then_some(p.top_p * sum), min_p, logits);
        }

        let sum = self.softmax_numerators(logits, max, inv_temperature);
        if !use_top_p && min_p == 0.0 {
            return self.draw_from_probs(sum, logits);
        }
        let target = p.top_p * sum;
        // Probabilities are relative to the top token (p_max = 1). Both the
        // nucleus and the min_p set are prefixes of the sorted order, so any
        // gathered prefix holding the answer suffices: {p >= min_p} always
        // does; otherwise lower the threshold until the mass reaches target.
        if min_p > 0.0 {
            self.gather_probs(min_p);
        } else {
            for tau in TOP_P_PROBES {
                let mass = self.gather_probs(tau);
                if mass >= target {
                    break;
                }
            }
        }
        self.finish(use_top_p.then_some(target), min_p, logits)
    }

    /// Fills `probs` with exp((logit - max) / T) (0 for NaN) and `block_sums`;
    /// returns the total.
    fn softmax_numerators(&mut self, logits: &[f32], max: f32, inv_temperature: f32) -> f32 {
        self.probs.resize(logits.len(), 0.0);
        self.block_sums.clear();
        let mut total = 0.0f32;
        for (out, block) in self.probs.chunks_mut(BLOCK).zip(logits.chunks(BLOCK)) {
            // Fixed-size arrays: no bounds checks, so the lane loop vectorises.
            let (out_chunks, out_tail) = out.as_chunks_mut::<LANES>();
            let (in_chunks, in_tail) = block.as_chunks::<LANES>();
            let mut lanes = [0.0f32; LANES];
            for (o, x) in out_chunks.iter_mut().zip(in_chunks) {
                for i in 0..LANES {
                    let p = exp_nonpositive((x[i] - max) * inv_temperature);
                    o[i] = p;
                    lanes[i] += p;
                }
            }
            let mut block_sum: f32 = lanes.iter().sum();
            for (o, &x) in out_tail.iter_mut().zip(in_tail) {
                *o = exp_nonpositive((x - max) * inv_temperature);
                block_sum += *o;
            }
            self.block_sums.push(block_sum);
            total += block_sum;
        }
        total
    }

    /// Draws from the full `probs`: find the block, then the token.
    fn draw_from_probs(&mut self, total: f32, logits: &[f32]) -> u32 {
        let r = self.rng.next_f32() * total;
        let mut acc = 0.0f32;
        for (b, &block_sum) in self.block_sums.iter().enumerate() {
            if r < acc + block_sum {
                let start = b * BLOCK;
                let mut inner = acc;
                let mut last_possible = None;
                for (i, &p) in self.probs[start..].iter().take(BLOCK).enumerate() {
                    inner += p;
                    if r < inner {
                        return (start + i) as u32;
                    }
                    if p > 0.0 {
                        last_possible = Some((start + i) as u32);
                    }
                }
                // Summation order differs from block_sum; rounding lands here.
                if let Some(id) = last_possible {
                    return id;
                }
            }
            acc += block_sum;
        }
        argmax(logits)
    }

    /// Candidates := tokens with probs >= tau (and > 0); returns their mass.
    fn gather_probs(&mut self, tau: f32) -> f32 {
        self.candidates.clear();
        // Everything kept must also be > 0.
        let floor = tau.max(f32::MIN_POSITIVE);
        let below = floor.next_down();
        let mut mass = 0.0f32;
        let (chunks, tail) = self.probs.as_chunks::<LANES>();
        let tail_start = chunks.len() * LANES;
        let blocks = chunks
            .iter()
            .enumerate()
            .map(|(c, chunk)| (c * LANES, chunk.as_slice()))
            .chain(std::iter::once((tail_start, tail)));
        for (start, block) in blocks {
            // Skip 16 tokens at once when none qualifies (the common case).
            if let Ok(chunk) = <&[f32; LANES]>::try_from(block)
                && !any_above(chunk, below)
            {
                continue;
            }
            for (i, &p) in block.iter().enumerate() {
                if p >= floor {
                    self.candidates.push(Candidate {
                        id: (start + i) as u32,
                        value: p,
                    });
                    mass += p;
                }
            }
        }
        mass
    }

    /// Candidates := the k largest logits (values are the raw logits).
    fn gather_top_k(&mut self, logits: &[f32], k: usize) {
        self.candidates.clear();
        if k <= HEAP_TOP_K_MAX {
            top_k_heap(logits, k, &mut self.heap);
            self.candidates
                .extend(self.heap.drain().map(|Reverse(r)| Candidate {
                    id: r.id,
                    value: r.logit,
                }));
        } else {
            self.candidates
                .extend(logits.iter().enumerate().filter(|(_, v)| !v.is_nan()).map(
                    |(id, &value)| Candidate {
                        id: id as u32,
                        value,
                    },
                ));
            if k < self.candidates.len() {
                self.candidates.select_nth_unstable_by(k - 1, by_value_desc);
                self.candidates.truncate(k);
            }
        }
    }

    /// Applies top-p (`target` mass) and min-p to the candidates, whose values
    /// are unnormalised probabilities with the top one at 1, then draws.
    fn finish(&mut self, top_p_target: Option<f32>, min_p: f32, logits: &[f32]) -> u32 {
        if let Some(target) = top_p_target {
            keep_top_p(&mut self.candidates, target);
        }
        if min_p > 0.0 {
            self.candidates.retain(|c| c.value >= min_p);
        }
        let total: f32 = self.candidates.iter().map(|c| c.value).sum();
        let r = self.rng.next_f32() * total;
        let mut acc = 0.0f32;
        let mut last_possible = None;
        for c in &self.candidates {
            acc += c.value;
            if r < acc {
                return c.id;
            }
            if c.value > 0.0 {
                last_possible = Some(c.id);
            }
        }
        // Rounding can put r at the very end of the range.
        last_possible.unwrap_or_else(|| argmax(logits))
    }
}

/// exp(x) for x <= 0 (NaN gives 0), branch-free so loops over it vectorise;
/// relative error ~1e-7, the precision of f32 itself. libm's expf is scalar
/// and dominated the cost of sampling a 150k vocabulary.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    // Below this exp(x) is subnormal; such tokens are worth nothing here.
    const MIN_X: f32 = -87.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(MIN_X, 0.0);
    // exp(x) = 2^n * exp(r), |r| <= ln2 / 2 (Cody-Waite reduction). Adding
    // 1.5 * 2^23 rounds to the nearest integer and leaves it in the low
    // mantissa bits: no `round` call, which baseline x86-64 lacks in SIMD.
    const ROUNDER: f32 = 12_582_912.0;
    let shifted = xc * std::f32::consts::LOG2_E + ROUNDER;
    // Wrapping ops: overflow checks (debug/test builds) would block vectorisation.
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let n = shifted - ROUNDER;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Taylor to degree 6: truncation error < 2e-8 relative on |r| <= 0.347.
    let poly = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    // Written so that NaN also gives 0.
    if x >= MIN_X { poly * scale } else { 0.0 }
}

/// Buckets for top-p: the top bits of a positive f32 (exponent and 4 mantissa
/// bits) are monotone in its value, so each bucket spans values within ~6%.
const BUCKET_SHIFT: u32 = 19;
const N_BUCKETS: usize = (1.0f32.to_bits() >> BUCKET_SHIFT) as usize + 1;

fn bucket(value: f32) -> usize {
    // Values are in [0, 1]; the min guards against anything unexpected.
    ((value.to_bits() >> BUCKET_SHIFT) as usize).min(N_BUCKETS - 1)
}

/// Keeps the smallest highest-probability set whose mass reaches `target`
/// (at least one token), in O(n): a histogram of mass per value bucket finds
/// the bucket where the cumulative mass crosses `target`; only that bucket is
/// sorted. A full sort of a 150k vocabulary would cost milliseconds per token.
fn keep_top_p(candidates: &mut Vec<Candidate>, target: f32) {
    let mut mass = [0.0f32; N_BUCKETS];
    for c in candidates.iter() {
        mass[bucket(c.value)] += c.value;
    }
    let mut above = 0.0f32; // mass of buckets strictly above `edge`
    let mut edge = N_BUCKETS - 1;
    // Empty buckets are passed over so the edge bucket always holds a token.
    while mass[edge] == 0.0 || above + mass[edge] < target {
        above += mass[edge];
        if edge == 0 {
            return; // rounding kept the total under target: keep everything
        }
        edge -= 1;
    }
    // Order: buckets above the edge (all kept), then the edge bucket; drop the rest.
    let mut n_above = 0;
    for i in 0..candidates.len() {
        if bucket(candidates[i].value) > edge {
            candidates.swap(i, n_above);
            n_above += 1;
        }
    }
    let mut n_kept = n_above;
    for i in n_above..candidates.len() {
        if bucket(candidates[i].value) == edge {
            candidates.swap(i, n_kept);
            n_kept += 1;
        }
    }
    candidates.truncate(n_kept);
    let edge_bucket = &mut candidates[n_above..];
    edge_bucket.sort_unstable_by(by_value_desc);
    let mut cumulative = above;
    let crossing = edge_bucket.iter().position(|c| {
        cumulative += c.value;
        cumulative >= target
    });
    // Rounding may never reach target: then the whole edge bucket stays.
    if let Some(i) = crossing {
        candidates.truncate(n_above + i + 1);
    }
}

/// Log-normaliser of a logit vector, computed with f64 accumulation.
struct LogNorm {
    log_sum_exp: f64,
    /// Count of +inf logits; when non-zero they share all the mass.
    n_pos_inf: usize,
}

impl LogNorm {
    fn new(logits: &[f32]) -> Self {
        let max = max_ignoring_nan(logits);
        if max == f32::INFINITY {
            let n_pos_inf = logits.iter().filter(|&&v| v == f32::INFINITY).count();
            return Self {
                log_sum_exp: f64::INFINITY,
                n_pos_inf,
            };
        }
        if max == f32::NEG_INFINITY {
            return Self {
                log_sum_exp: f64::NEG_INFINITY,
                n_pos_inf: 0,
            };
        }
        // exp in f32 (relative error ~1e-7, below what an f32 logprob shows),
        // accumulated in f64 lanes so the loop vectorises.
        let mut lanes = [0.0f64; LANES];
        let (chunks, tail) = logits.as_chunks::<LANES>();
        for chunk in chunks {
            for i in 0..LANES {
                lanes[i] += f64::from(exp_nonpositive(chunk[i] - max));
            }
        }
        let sum: f64 = lanes.iter().sum::<f64>()
            + tail
                .iter()
                .map(|&v| f64::from(exp_nonpositive(v - max)))
                .sum::<f64>();
        let max = f64::from(max);
        Self {
            log_sum_exp: max + sum.ln(),
            n_pos_inf: 0,
        }
    }

    fn logprob(&self, logit: f32) -> f32 {
        if logit.is_nan() {
            f32::NEG_INFINITY
        } else if self.n_pos_inf > 0 {
            if logit == f32::INFINITY {
                -(self.n_pos_inf as f64).ln() as f32
            } else {
                f32::NEG_INFINITY
            }
        } else if self.log_sum_exp == f64::NEG_INFINITY {
            f32::NEG_INFINITY
        } else {
            (f64::from(logit) - self.log_sum_exp) as f32
        }
    }
}

/// Heap entry ordered so that the heap's minimum is the weakest kept token.
#[derive(Debug, Clone, Copy)]
struct Ranked {
    id: u32,
    logit: f32,
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        // Larger logit ranks higher; on ties the lower id ranks higher.
        self.logit
            .total_cmp(&other.logit)
            .then(other.id.cmp(&self.id))
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ranked {}

/// Fills `heap` with the `k` largest non-NaN logits (lowest ids on ties) in
/// one pass. Nearly every token fails a single comparison against the weakest
/// kept logit, so this is a scan, not V heap operations.
fn top_k_heap(logits: &[f32], k: usize, heap: &mut BinaryHeap<Reverse<Ranked>>) {
    heap.clear();
    if k == 0 {
        return;
    }
    // Valid once the heap is full. A later token with an equal logit has a
    // higher id, so it never outranks the weakest: `>` suffices.
    let mut threshold = f32::NEG_INFINITY;
    let mut offer = |id: usize, logit: f32, threshold: &mut f32| {
        if heap.len() < k {
            if !logit.is_nan() {
                heap.push(Reverse(Ranked {
                    id: id as u32,
                    logit,
                }));
                if heap.len() == k {
                    *threshold = heap.peek().map_or(f32::NEG_INFINITY, |w| w.0.logit);
                }
            }
        } else if logit > *threshold {
            if let Some(mut weakest) = heap.peek_mut() {
                *weakest = Reverse(Ranked {
                    id: id as u32,
                    logit,
                });
            }
            *threshold = heap.peek().map_or(f32::NEG_INFINITY, |w| w.0.logit);
        }
    };
    let (chunks, tail) = logits.as_chunks::<LANES>();
    let mut filled = false;
    for (c, chunk) in chunks.iter().enumerate() {
        // Once full, most chunks hold nothing above the threshold; a
        // branch-free test skips them 16 tokens at a time.
        if filled && !any_above(chunk, threshold) {
            continue;
        }
        for (i, &logit) in chunk.iter().enumerate() {
            offer(c * LANES + i, logit, &mut threshold);
        }
        filled = threshold > f32::NEG_INFINITY;
    }
    let base = chunks.len() * LANES;
    for (i, &logit) in tail.iter().enumerate() {
        offer(base + i, logit, &mut threshold);
    }
}

/// Whether any value exceeds `threshold` (NaN never does), without branches.
#[inline(always)]
fn any_above(chunk: &[f32; LANES], threshold: f32) -> bool {
    chunk.iter().fold(false, |any, &v| any | (v > threshold))
}

/// The `n` most likely tokens under log_softmax(logits), by descending
/// logprob (lowest id first on ties). NaN logits are never returned.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 || logits.is_empty() {
        return Vec::new();
    }
    let norm = LogNorm::new(logits);
    let mut heap = BinaryHeap::with_capacity(n.min(logits.len()));
    top_k_heap(logits, n, &mut heap);
    // Ascending order of Reverse is descending order of Ranked.
    heap.into_sorted_vec()
        .into_iter()
        .map(|Reverse(r)| (r.id, norm.logprob(r.logit)))
        .collect()
}

/// `log_softmax(logits)[id]`; `-inf` for an id outside the logits.
pub fn logprob_of(logits: &[f32], id: u32) -> f32 {
    match logits.get(id as usize) {
        Some(&logit) => LogNorm::new(logits).logprob(logit),
        None => f32::NEG_INFINITY,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: Some(seed),
            penalties: Penalties::NONE,
        }
    }

    fn logits_from_probs(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    fn histogram(sampler: &mut Sampler, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut counts = vec![0; logits.len()];
        for _ in 0..draws {
            counts[sampler.sample(logits) as usize] += 1;
        }
        counts
    }

    #[test]
    fn validate_rejects_bad_values() {
        assert_eq!(SamplingParams::default().validate(), Ok(()));
        assert!(SamplingParams::default().is_greedy());
        let bad = |f: fn(&mut SamplingParams)| {
            let mut p = SamplingParams::default();
            f(&mut p);
            p.validate().unwrap_err()
        };
        assert_eq!(
            bad(|p| p.temperature = -0.1),
            SamplingError::Temperature(-0.1)
        );
        assert!(matches!(
            bad(|p| p.temperature = f32::NAN),
            SamplingError::Temperature(_)
        ));
        assert!(matches!(
            bad(|p| p.temperature = f32::INFINITY),
            SamplingError::Temperature(_)
        ));
        assert_eq!(bad(|p| p.top_p = 0.0), SamplingError::TopP(0.0));
        assert_eq!(bad(|p| p.top_p = 1.5), SamplingError::TopP(1.5));
        assert!(matches!(
            bad(|p| p.top_p = f32::NAN),
            SamplingError::TopP(_)
        ));
        assert_eq!(bad(|p| p.min_p = -0.5), SamplingError::MinP(-0.5));
        assert_eq!(bad(|p| p.min_p = 1.01), SamplingError::MinP(1.01));
        assert!(matches!(
            bad(|p| p.min_p = f32::NAN),
            SamplingError::MinP(_)
        ));
        assert!(bad(|p| p.top_p = 2.0).to_string().contains("top_p"));
    }

    #[test]
    fn greedy_picks_lowest_id_on_ties_and_ignores_nan() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(s.sample(&[f32::NAN, 0.5, f32::NAN, 0.7]), 3);
        assert_eq!(s.sample(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(s.sample(&[]), 0);
        assert_eq!(s.sample(&[f32::NAN]), 0);
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let mut greedy = Sampler::new(SamplingParams::default());
        let mut k1 = Sampler::new(params(1.5, 1, 0.9, 0.0, 7));
        let mut state = 42u64;
        for _ in 0..50 {
            let logits: Vec<f32> = (0..100)
                .map(|_| (splitmix64(&mut state) % 1000) as f32 / 100.0)
                .collect();
            assert_eq!(k1.sample(&logits), greedy.sample(&logits));
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37) % 101) as f32 / 20.0).collect();
        let p = params(0.8, 50, 0.95, 0.01, 1234);
        let run = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(p), run(p));
        assert_ne!(
            run(p),
            run(SamplingParams {
                seed: Some(4321),
                ..p
            })
        );
        // Unseeded samplers draw from entropy and differ.
        let unseeded = SamplingParams { seed: None, ..p };
        assert_ne!(run(unseeded), run(unseeded));
    }

    #[test]
    fn plain_temperature_follows_the_distribution() {
        let logits = logits_from_probs(&[0.5, 0.25, 0.125, 0.125]);
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, 3));
        let counts = histogram(&mut s, &logits, 8000);
        for (count, p) in counts.iter().zip([0.5, 0.25, 0.125, 0.125]) {
            let freq = *count as f64 / 8000.0;
            assert!((freq - p).abs() < 0.03, "{counts:?}");
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Cumulative: 0.4, 0.7, 0.9, 1.0 -> top_p 0.5 keeps {0, 1}.
        let logits = logits_from_probs(&[0.1, 0.4, 0.2, 0.3]);
        let mut s = Sampler::new(params(1.0, 0, 0.5, 0.0, 11));
        let counts = histogram(&mut s, &logits, 2000);
        assert_eq!(counts[0] + counts[2], 0, "{counts:?}");
        // Renormalised 0.4 : 0.3.
        let freq1 = counts[1] as f64 / 2000.0;
        assert!((freq1 - 4.0 / 7.0).abs() < 0.05, "{counts:?}");

        // A nucleus wider than the first partial sort (64 tokens).
        let flat = vec![0.0f32; 1000];
        let mut s = Sampler::new(params(1.0, 0, 0.5, 0.0, 5));
        let ids: Vec<u32> = (0..2000).map(|_| s.sample(&flat)).collect();
        assert!(ids.iter().all(|&id| id <= 500), "ties keep the lowest ids");
        assert!(ids.iter().any(|&id| id > 400));

        // top_p so small that nothing reaches it still keeps the top token.
        let mut s = Sampler::new(params(1.0, 0, 1e-9, 0.0, 5));
        assert!((0..100).all(|_| s.sample(&logits) == 1));
    }

    #[test]
    fn top_k_and_min_p_filter() {
        let logits = logits_from_probs(&[0.05, 0.5, 0.15, 0.3]);
        let mut s = Sampler::new(params(1.0, 2, 1.0, 0.0, 9));
        let counts = histogram(&mut s, &logits, 2000);
        assert_eq!(counts[0] + counts[2], 0, "{counts:?}");

        // min_p 0.2: threshold 0.1 drops token 0 (0.05) and keeps 2 (0.15).
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.2, 9));
        let counts = histogram(&mut s, &logits, 2000);
        assert_eq!(counts[0], 0, "{counts:?}");
        assert!(counts[2] > 0, "{counts:?}");

        // min_p 1 keeps only the maximum.
        let mut s = Sampler::new(params(1.0, 0, 1.0, 1.0, 9));
        assert!((0..100).all(|_| s.sample(&logits) == 1));
    }

    #[test]
    fn sampling_survives_odd_logits() {
        let mut s = Sampler::new(params(0.7, 0, 0.9, 0.05, 1));
        assert_eq!(s.sample(&[]), 0);
        assert_eq!(s.sample(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(s.sample(&[0.0, f32::INFINITY, 1.0]), 1);
        let logits = [f32::NEG_INFINITY, 2.0, f32::NAN, f32::NEG_INFINITY];
        assert!((0..100).all(|_| s.sample(&logits) == 1));
        // A temperature so small the scaled logits overflow behaves as greedy.
        let mut s = Sampler::new(params(1e-38, 0, 1.0, 0.0, 1));
        assert_eq!(s.sample(&[1.0, 5.0, 2.0]), 1);
    }

    #[test]
    fn fast_exp_is_accurate() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_nonpositive(x));
            assert!(
                ((got - want) / want).abs() < 3e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.013;
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(f32::NAN), 0.0);
    }

    #[test]
    fn full_vocabulary_draw_spans_blocks() {
        // Mass in four different BLOCKs; everything else impossible.
        let mut logits = vec![f32::NEG_INFINITY; 1000];
        let mass = [(10, 0.1), (300, 0.2), (600, 0.3), (999, 0.4)];
        for (id, p) in mass {
            logits[id] = (p as f32).ln();
        }
        logits[500] = f32::NAN;
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, 17));
        let counts = histogram(&mut s, &logits, 10_000);
        for (id, p) in mass {
            let freq = counts[id] as f64 / 10_000.0;
            assert!((freq - p).abs() < 0.02, "{id}: {freq}");
        }
        assert_eq!(
            counts.iter().sum::<usize>(),
            counts[10] + counts[300] + counts[600] + counts[999]
        );
    }

    #[test]
    fn top_p_nucleus_beyond_the_first_probe() {
        // One token at relative probability 1 and 10,000 at e^-5 (< 1e-2):
        // the top token alone is 1.5% of the mass, so the nucleus needs about
        // 9,000 of the tail, lowest ids first.
        let mut logits = vec![-5.0f32; 10_001];
        logits[0] = 0.0;
        let mut s = Sampler::new(params(1.0, 0, 0.9, 0.0, 23));
        let ids: Vec<u32> = (0..300).map(|_| s.sample(&logits)).collect();
        let max_id = *ids.iter().max().unwrap();
        // 1 + n e^-5 >= 0.9 (1 + 10^4 e^-5) first holds at n = 8986.
        assert!((8500..=8986).contains(&max_id), "{max_id}");
        // With min_p 0.01 the tail is dropped entirely (e^-5 < 0.01).
        let mut s = Sampler::new(params(1.0, 0, 0.9, 0.01, 23));
        assert!((0..200).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn large_top_k_uses_partial_sort() {
        let logits: Vec<f32> = (0..5000).map(|i| -(i as f32) / 1000.0).collect();
        let mut s = Sampler::new(params(1.0, 2000, 1.0, 0.0, 29));
        let ids: Vec<u32> = (0..3000).map(|_| s.sample(&logits)).collect();
        assert!(ids.iter().all(|&id| id < 2000));
        assert!(ids.iter().any(|&id| id > 1500));
    }

    #[test]
    fn top_logprobs_are_normalised_and_sorted() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5, f32::NAN];
        let all = top_logprobs(&logits, 10);
        assert_eq!(all.len(), 5, "NaN is never returned");
        let ids: Vec<u32> = all.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, [1, 2, 0, 4, 3]);
        let total: f64 = all.iter().map(|&(_, lp)| f64::from(lp).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        for &(id, lp) in &all {
            assert_eq!(lp, logprob_of(&logits, id));
        }
        let top2 = top_logprobs(&logits, 2);
        assert_eq!(top2, all[..2].to_vec());
        // Longer than one chunk of lanes, ties across chunks keep the lowest ids.
        let mut long = vec![0.0f32; 100];
        long[70] = 2.0;
        long[3] = 2.0;
        long[90] = 1.0;
        let ids: Vec<u32> = top_logprobs(&long, 4).iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, [3, 70, 90, 0]);
        assert!(top_logprobs(&logits, 0).is_empty());
        assert_eq!(logprob_of(&logits, 99), f32::NEG_INFINITY);

        // Large logits do not overflow thanks to the max shift.
        let big = [1000.0f32, 1000.0];
        let lp = top_logprobs(&big, 1)[0].1;
        assert!((lp - (-std::f32::consts::LN_2)).abs() < 1e-6, "{lp}");
        // +inf logits share the mass.
        assert_eq!(logprob_of(&[f32::INFINITY, 0.0], 1), f32::NEG_INFINITY);
        assert_eq!(logprob_of(&[f32::INFINITY, 0.0], 0), 0.0);
    }
}
