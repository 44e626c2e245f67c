//! Which instruction set, and which weight layout, each quantized type's kernels run with:
//! chosen once per process by timing every candidate the CPU can run.
//!
//! The best instruction set is not always the widest: Zen 4 executes AVX-512 as two 256-bit
//! halves, and which kernel wins there depends on the type's unpacking work. So the first
//! quantized product (or [`choose`], called at load) times each candidate on one core, on a
//! small matrix that stays in L2 (what a kernel can consume, not what memory delivers), a few
//! rounds taken in turn, and keeps the fastest. Every candidate computes the same bits (the
//! kernels' tests check it), so the choice changes speed only. `EMBER_CPU_ISA` skips the
//! timing and takes the named set, as it always has, for tests and comparisons.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::super::Isa;
use super::act::{ActJob, ActKind, ActLayout, quantize_activations};
use super::rows::{QIsa, QJob, quant_rows};
use super::x16::{X16, interleave, interleaves, runs_on};
use crate::dtype::DType;

/// One type's kernels: the set they run with, whether its weights are interleaved, and what
/// each candidate measured.
#[derive(Clone, Debug)]
pub(crate) struct Choice {
    pub isa: QIsa,
    pub interleaved: bool,
    /// `(candidate, GB/s of weights)`, the chosen one first; empty when not measured.
    pub measured: Vec<(String, f64)>,
}

/// The quantized types ember's kernels run.
const TYPES: [DType; 6] = [
    DType::Q4_0,
    DType::Q4_1,
    DType::Q8_0,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
];

/// The choice for `dtype` (a quantized type), made on first use.
pub(crate) fn choice(dtype: DType) -> &'static Choice {
    let choices = choose();
    let at = TYPES
        .iter()
        .position(|&t| t == dtype)
        .unwrap_or_else(|| unreachable!("{dtype} has no quantized kernels"));
    &choices.1[at]
}

/// Makes the choices (once per process) and returns how long that took with them.
pub(crate) fn choose() -> &'static (Duration, Vec<Choice>) {
    static CHOICES: OnceLock<(Duration, Vec<Choice>)> = OnceLock::new();
    CHOICES.get_or_init(|| {
        let started = Instant::now();
        let forced = std::env::var_os("EMBER_CPU_ISA").is_some();
        let choices = TYPES
            .iter()
            .map(|&dtype| {
                if forced {
                    let isa = QIsa::from_isa(Isa::detect());
                    let interleaved = runs_on(dtype, isa);
                    Choice {
                        isa,
                        interleaved,
                        measured: Vec::new(),
                    }
                } else {
                    measure(dtype)
                }
            })
            .collect();
        (started.elapsed(), choices)
    })
}

/// What the chosen kernels of `types` are, for the load line: `q4_k avx512-vnni x16, …`.
pub(crate) fn summary(types: &[DType]) -> String {
    TYPES
        .iter()
        .zip(&choose().1)
        .filter(|(t, _)| types.contains(t))
        .map(|(t, c)| {
            format!(
                "{} {}",
                t.name().to_lowercase(),
                label(c.isa, c.interleaved)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every candidate's rate, for a log line: `q4_k: avx512-vnni x16 56.1 GB/s, … (80 ms)`.
pub(crate) fn report() -> String {
    let (took, choices) = choose();
    let types: Vec<String> = TYPES
        .iter()
        .zip(choices)
        .filter(|(_, c)| !c.measured.is_empty())
        .map(|(t, c)| {
            let rates: Vec<String> = c
                .measured
                .iter()
                .map(|(name, rate)| format!("{name} {rate:.1}"))
                .collect();
            format!("{}: {}", t.name().to_lowercase(), rates.join(", "))
        })
        .collect();
    if types.is_empty() {
        return "set by EMBER_CPU_ISA, not measured".to_string();
    }
    format!(
        "{} (GB/s of weights, one core, fastest first; {} ms)",
        types.join("; "),
        took.as_millis()
    )
}

fn label(isa: QIsa, interleaved: bool) -> String {
    let name = match isa {
        QIsa::Avx512Vnni => "avx512-vnni",
        QIsa::Avx512 => "avx512",
        QIsa::Avx2 => "avx2",
        QIsa::Portable => "portable",
    };
    if interleaved {
        format!("{name} x16")
    } else {
        name.to_string()
    }
}

/// Rows and columns of the matrix a candidate is timed on: 150-280 KB, in L2.
const ROWS: usize = 64;
const COLS: usize = 2048;
/// How long each timing runs, and how many rounds the candidates take in turn.
const TIMING: Duration = Duration::from_micros(1500);
const ROUNDS: usize = 3;

fn measure(dtype: DType) -> Choice {
    // The sets worth timing: SIMD ones when there are any (plain Rust never wins then).
    let mut sets = QIsa::available();
    if sets.len() > 1 {
        sets.retain(|&s| s != QIsa::Portable);
    }
    let mut candidates: Vec<(QIsa, bool)> = Vec::new();
    for &isa in &sets {
        if runs_on(dtype, isa) {
            candidates.push((isa, true));
        }
        candidates.push((isa, false));
    }
    let plain = weights(dtype);
    let mut interleaved = vec![0u8; plain.len()];
    if interleaves(dtype) {
        interleave(dtype, &plain, ROWS, COLS, &mut interleaved);
    }
    // One activation row in each layout the candidates read.
    let x: Vec<f32> = (0..COLS)
        .map(|i| ((i * 37) % 101) as f32 * 0.02 - 1.0)
        .collect();
    let quantized = |kind: ActKind| {
        let layout = ActLayout::new(kind, COLS);
        let mut acts = vec![0u64; layout.stride.div_ceil(8) + 8];
        let offset = acts.as_ptr().cast::<u8>().align_offset(64);
        let out = unsafe { acts.as_mut_ptr().cast::<u8>().add(offset) };
        let job = ActJob {
            x: x.as_ptr(),
            rows: (0, 1),
            layout,
            out,
        };
        quantize_activations(Isa::detect(), job);
        (layout, acts, offset)
    };
    let plain_acts = quantized(ActKind::for_weights(dtype));
    let interleaved_acts = quantized(ActKind::for_interleaved(dtype));
    let mut y = vec![0f32; ROWS];
    let mut best = vec![f64::INFINITY; candidates.len()];
    for _ in 0..ROUNDS {
        for (at, &(isa, inter)) in candidates.iter().enumerate() {
            let w = if inter { &interleaved } else { &plain };
            let (layout, acts, offset) = match inter {
                true => &interleaved_acts,
                false => &plain_acts,
            };
            let (base, layout) = (unsafe { acts.as_ptr().cast::<u8>().add(*offset) }, *layout);
            let job = QJob {
                w: w.as_ptr(),
                row_bytes: dtype.row_bytes(COLS),
                n: ROWS,
                rows: (0, ROWS),
                acts: base,
                layout,
                m: 1,
                block_rows: 1,
                y: y.as_mut_ptr(),
                wide: 0,
                tiles: std::ptr::null(),
                panel: std::ptr::null_mut(),
                block_tiles: 1,
                interleaved: inter,
            };
            let started = Instant::now();
            let mut runs = 0u32;
            while started.elapsed() < TIMING {
                quant_rows(isa, dtype, job);
                runs += 1;
            }
            let per_run = started.elapsed().as_secs_f64() / f64::from(runs);
            best[at] = best[at].min(per_run);
        }
    }
    let mut measured: Vec<(usize, f64)> = best
        .iter()
        .enumerate()
        .map(|(at, &secs)| (at, plain.len() as f64 / secs / 1e9))
        .collect();
    measured.sort_by(|a, b| b.1.total_cmp(&a.1));
    let (isa, interleaved) = candidates[measured[0].0];
    Choice {
        isa,
        interleaved,
        measured: measured
            .iter()
            .map(|&(at, rate)| (label(candidates[at].0, candidates[at].1), rate))
            .collect(),
    }
}

/// Weights of `dtype` to time on: any bytes, with every scale a plain 1.0 (never a NaN or a
/// subnormal, which some CPUs compute slowly).
fn weights(dtype: DType) -> Vec<u8> {
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut bytes: Vec<u8> = (0..ROWS * dtype.row_bytes(COLS))
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect();
    let scales: &[usize] = match dtype {
        DType::Q8_0 | DType::Q4_0 => &[0],
        DType::Q4_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q6_K => &[208],
        _ => unreachable!("{dtype} has no quantized kernels"),
    };
    for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
        for &at in scales {
            block[at..at + 2].copy_from_slice(&half::f16::ONE.to_bits().to_le_bytes());
        }
    }
    debug_assert!(ROWS.is_multiple_of(X16));
    bytes
}
