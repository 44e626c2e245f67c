//! The sampler's random numbers: xoshiro256** seeded through splitmix64, and a seed for
//! requests that give none.

/// xoshiro256** (Blackman & Vigna), seeded through splitmix64 as its authors
/// recommend. Small, fast, and reproducible across platforms.
#[derive(Debug, Clone)]
pub(super) struct Xoshiro256StarStar {
    s: [u64; 4],
}

pub(super) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Xoshiro256StarStar {
    pub(super) fn seed_from_u64(seed: u64) -> Self {
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

    pub(super) fn next_u64(&mut self) -> u64 {
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
    pub(super) fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
}

/// A seed for unseeded requests: std's per-process random hash keys mixed
/// with the clock and a counter, so concurrent samplers differ.
pub(super) fn entropy_seed() -> u64 {
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
}
