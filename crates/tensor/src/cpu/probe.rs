//! A memory read probe: the bandwidth ceiling decode is measured against.

use super::simd::Simd;
use super::{Isa, SharedPtr, simd_dispatch};
use crate::pool::ThreadPool;

/// Sums `data` with every thread reading its own contiguous part, at full vector width and with
/// independent accumulators, so the loop is limited by memory, not by arithmetic.
pub fn read_sum(pool: &ThreadPool, data: &[f32]) -> f32 {
    let partial: Vec<std::sync::Mutex<f32>> = (0..pool.n_threads())
        .map(|_| std::sync::Mutex::new(0.0))
        .collect();
    let isa = Isa::detect();
    let base = SharedPtr(data.as_ptr() as *mut f32);
    let parts = pool.n_threads();
    pool.broadcast(&|thread| {
        let range = crate::pool::split_range(data.len(), parts, thread);
        // SAFETY: each thread reads its own range of `data`.
        let sum = sum_range(
            isa,
            SharedPtr(unsafe { base.get().add(range.start) }),
            range.len(),
        );
        *partial[thread].lock().unwrap_or_else(|p| p.into_inner()) = sum;
    });
    partial
        .iter()
        .map(|p| *p.lock().unwrap_or_else(|e| e.into_inner()))
        .sum()
}

simd_dispatch!(fn sum_range(ptr: SharedPtr<f32>, len: usize) -> f32 => sum_generic);

#[inline(always)]
unsafe fn sum_generic<S: Simd>(ptr: SharedPtr<f32>, len: usize) -> f32 {
    unsafe {
        let p = ptr.get() as *const f32;
        let mut acc = [S::zero(); 4];
        let step = 4 * S::LANES;
        let full = len / step * step;
        let mut i = 0;
        while i < full {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = S::add(*a, S::load(p.add(i + j * S::LANES)));
            }
            i += step;
        }
        let mut total = S::hsum(S::add(S::add(acc[0], acc[1]), S::add(acc[2], acc[3])));
        while i < len {
            total += *p.add(i);
            i += 1;
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_everything_once() {
        let pool = ThreadPool::new(2);
        let data: Vec<f32> = (0..1001).map(|i| (i % 7) as f32).collect();
        assert_eq!(read_sum(&pool, &data), data.iter().sum::<f32>());
    }
}
