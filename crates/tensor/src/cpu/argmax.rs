//! Greedy choice over a row of logits, on the host: the rule every backend's greedy pick
//! follows (the CUDA `argmax` kernel gives the same index).

/// The largest value, NaN ignored; -inf for none. Sixteen independent lanes let the compiler
/// vectorise the scan.
pub fn max_ignoring_nan(values: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(v);
        }
    }
    lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// The index of the largest value: the lowest on ties, NaN never chosen, 0 for an empty row or
/// one of only NaN.
pub fn argmax(values: &[f32]) -> u32 {
    let max = max_ignoring_nan(values);
    values
        .iter()
        .position(|&v| v == max)
        .map_or(0, |i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_low_and_nan_is_never_chosen() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 2.0]), 3);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
        // Past the vectorised lanes: the tail and a late maximum.
        let mut long: Vec<f32> = (0..100).map(|i| i as f32 * 0.5).collect();
        long[37] = 1e9;
        long[90] = 1e9;
        assert_eq!(argmax(&long), 37);
        assert_eq!(max_ignoring_nan(&long), 1e9);
    }
}
