//! Next-token sampling (temperature, top-k, top-p, min-p) and logprobs.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Per-request sampling settings. The default is greedy decoding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus sampling mass; 1 = off.
    pub top_p: f32,
    /// Drop tokens with p < min_p * p_max; 0 = off.
    pub min_p: f32,
    /// Fixed seed for reproducible draws; `None` seeds from entropy.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
        }
    }
}

/// An out-of-range sampling parameter; names the field.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        // Written so that NaN fails every check.
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(SamplingError::MinP(self.min_p));
        }
        Ok(())
    }

    /// True when sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        // A NaN temperature (unvalidated params) also goes to argmax.
        self.temperature.is_nan() || self.temperature <= 0.0 || self.top_k == 1
    }
}

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

/// Samples token ids from logits. Holds its RNG and a reusable candidate buffer.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256StarStar,
    candidates: Vec<Candidate>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(entropy_seed);
        Self {
            params,
            rng: Xoshiro256StarStar::seed_from_u64(seed),
            candidates: Vec::new(),
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
        let inv_temperature = 1.0 / p.temperature;
        let candidates = &mut self.candidates;
        candidates.clear();
        for (id, &logit) in logits.iter().enumerate() {
            let value = logit * inv_temperature;
            if value == f32::INFINITY {
                // An infinite logit (or a temperature so small it overflows)
                // owns all the mass.
                return argmax(logits);
            }
            if value.is_nan() || value == f32::NEG_INFINITY {
                continue; // zero probability
            }
            candidates.push(Candidate {
                id: id as u32,
                value,
            });
        }
        if candidates.is_empty() {
            return argmax(logits);
        }

        if p.top_k > 0 && p.top_k < candidates.len() {
            candidates.select_nth_unstable_by(p.top_k - 1, by_value_desc);
            candidates.truncate(p.top_k);
        }

        let max = candidates
            .iter()
            .map(|c| c.value)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for c in candidates.iter_mut() {
            c.value = (c.value - max).exp();
            sum += c.value;
        }

        if p.top_p < 1.0 {
            keep_top_p(candidates, p.top_p * sum);
        }
        if p.min_p > 0.0 {
            // Probabilities are unnormalised with p_max = exp(0) = 1, so the
            // threshold is min_p itself; the top token always survives.
            let threshold = p.min_p.min(1.0);
            candidates.retain(|c| c.value >= threshold);
        }

        let total: f32 = candidates.iter().map(|c| c.value).sum();
        let r = self.rng.next_f32() * total;
        let mut acc = 0.0f32;
        for c in candidates.iter() {
            acc += c.value;
            if r < acc {
                return c.id;
            }
        }
        // Rounding can leave r just above the final sum.
        candidates.last().map_or(0, |c| c.id)
    }
}

/// Keeps the smallest highest-probability prefix whose mass reaches `target`
/// (at least one token). Sorts only as much as needed: a nucleus is usually
/// far smaller than the vocabulary.
fn keep_top_p(candidates: &mut Vec<Candidate>, target: f32) {
    let len = candidates.len();
    let mut m = len.min(64);
    loop {
        if m < len {
            candidates.select_nth_unstable_by(m - 1, by_value_desc);
        }
        candidates[..m].sort_unstable_by(by_value_desc);
        let mut cumulative = 0.0f32;
        for i in 0..m {
            cumulative += candidates[i].value;
            if cumulative >= target {
                candidates.truncate(i + 1);
                return;
            }
        }
        if m == len {
            return; // rounding kept the sum under target: keep everything
        }
        m = (m * 8).min(len);
    }
}

/// Index of the largest logit, lowest id on ties; NaN is ignored.
fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// Log-normaliser of a logit vector, computed with f64 accumulation.
struct LogNorm {
    log_sum_exp: f64,
    /// Count of +inf logits; when non-zero they share all the mass.
    n_pos_inf: usize,
}

impl LogNorm {
    fn new(logits: &[f32]) -> Self {
        let max = logits
            .iter()
            .filter(|v| !v.is_nan())
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
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
        let max = f64::from(max);
        let sum: f64 = logits
            .iter()
            .filter(|v| !v.is_nan())
            .map(|&v| (f64::from(v) - max).exp())
            .sum();
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
#[derive(Clone, Copy)]
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

/// The `n` most likely tokens under log_softmax(logits), by descending
/// logprob (lowest id first on ties). NaN logits are never returned.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 || logits.is_empty() {
        return Vec::new();
    }
    let norm = LogNorm::new(logits);
    // A size-n min-heap: O(V log n) instead of sorting the vocabulary.
    let mut heap: BinaryHeap<Reverse<Ranked>> = BinaryHeap::with_capacity(n + 1);
    for (id, &logit) in logits.iter().enumerate() {
        if logit.is_nan() {
            continue;
        }
        let entry = Ranked {
            id: id as u32,
            logit,
        };
        if heap.len() < n {
            heap.push(Reverse(entry));
        } else if heap.peek().is_some_and(|Reverse(weakest)| entry > *weakest) {
            heap.pop();
            heap.push(Reverse(entry));
        }
    }
    // Ascending order of Reverse is descending order of Ranked.
    heap.into_sorted_vec()
        .into_iter()
        .map(|Reverse(r)| (r.id, norm.logprob(r.logit)))
        .collect()
}

/// log_softmax(logits)[id]; `-inf` for an id outside the logits.
pub fn logprob_of(logits: &[f32], id: u32) -> f32 {
    match logits.get(id as usize) {
        Some(&logit) => LogNorm::new(logits).logprob(logit),
        None => f32::NEG_INFINITY,
    }
}

/// xoshiro256** (Blackman & Vigna), seeded through splitmix64 as its authors
/// recommend. Small, fast, and reproducible across platforms.
#[derive(Debug, Clone)]
struct Xoshiro256StarStar {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Xoshiro256StarStar {
    fn seed_from_u64(seed: u64) -> Self {
        let mut state = seed;
        // splitmix64 never yields four zero words, the one invalid state.
        let s = [
            splitmix64(&mut state),
            splitmix64(&mut state),
            splitmix64(&mut state),
            splitmix64(&mut state),
        ];
        Self { s }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 24 bits of precision.
    fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
}

/// A seed for unseeded requests: std's per-process random hash keys mixed
/// with the clock and a counter, so concurrent samplers differ.
fn entropy_seed() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    std::collections::hash_map::RandomState::new().hash_one((nanos, count))
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
    fn xoshiro_and_splitmix_reference_values() {
        // Reference outputs of the C implementations.
        let mut rng = Xoshiro256StarStar { s: [1, 2, 3, 4] };
        let out: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
        assert_eq!(out, [11520, 0, 1509978240, 1215971899390074240]);
        let mut state = 1234567;
        let out: Vec<u64> = (0..3).map(|_| splitmix64(&mut state)).collect();
        assert_eq!(
            out,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423
            ]
        );
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
