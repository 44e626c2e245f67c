//! CPU kernels: run-time dispatch over AVX-512, AVX2 and a portable fallback.
//!
//! Every kernel computes an output element the same way whatever the thread count and whatever
//! the batch size: a row's result never depends on the rows beside it, so prefill and decode,
//! batched and alone, give bit-identical results on one machine. The GGUF path's quantized
//! products (see [`matmul`]) and attention over an f16 cache (see [`causal_attention`]) compute
//! every row as llama.cpp's CPU backend computes a lone token, also where llama.cpp itself
//! changes kernels for a batch.

mod argmax;
mod attention;
mod elementwise;
mod isa;
mod mat_ref;
mod matmul;
mod probe;
mod quant_dot;
pub(crate) mod simd;

pub use argmax::{argmax, max_ignoring_nan};
pub use attention::{AttentionShape, KvSlice, PagedKv, attention_scratch_len, causal_attention};
pub use elementwise::{
    RopeLayout, RopeTables, add_assign, add_bias, rms_norm, rms_norm_in_place, rope_in_place,
    silu_mul, softmax_in_place,
};
pub use isa::Isa;
pub use mat_ref::{MatRef, WeightLayout};
pub use matmul::{
    matmul, matmul_scratch_len, matmul_shared_input, quant_kernel_report, quant_kernels,
};
pub use probe::read_sum;

/// A raw pointer that threads of one parallel region share; each thread touches a part of the
/// memory no other thread touches (the callers' split guarantees it).
#[derive(Clone, Copy)]
pub(crate) struct SharedPtr<T>(pub *mut T);

// SAFETY: only used for disjoint accesses inside one `ThreadPool` region.
unsafe impl<T> Send for SharedPtr<T> {}
unsafe impl<T> Sync for SharedPtr<T> {}

impl<T> SharedPtr<T> {
    #[inline(always)]
    pub fn get(self) -> *mut T {
        self.0
    }
}

/// Defines `$name(isa, args…)`, which runs `$generic::<S>(args…)` compiled for the chosen set.
/// The generic body and everything it calls must be `#[inline(always)]`, so that it is
/// compiled with the entry point's target features.
macro_rules! simd_dispatch {
    ($vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? => $generic:ident) => {
        #[allow(clippy::too_many_arguments)]
        $vis fn $name(isa: $crate::cpu::Isa, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                unsafe { $generic::<$crate::cpu::simd::Avx512>($($arg),*) }
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                unsafe { $generic::<$crate::cpu::simd::Avx2>($($arg),*) }
            }
            match isa {
                // SAFETY: `Isa::detect` only reports sets the CPU has.
                #[cfg(target_arch = "x86_64")]
                $crate::cpu::Isa::Avx512 => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                $crate::cpu::Isa::Avx2 => unsafe { avx2($($arg),*) },
                _ => unsafe { $generic::<$crate::cpu::simd::Portable>($($arg),*) },
            }
        }
    };
}
pub(crate) use simd_dispatch;
