use super::act::{ActKind, ActLayout, quantize_activation_row};
use super::rows::{QIsa, QJob, quant_rows};
use super::tiles::{hsum_float_8, rdf32};
use super::wide::{TM, build_tiles, panel_bytes, tiles_bytes, wide_rows};
use super::x16::{X16, interleave, plain_row};
use crate::dtype::DType;
use crate::quant::{
    BlockQ8_0, BlockQ8_1, BlockQ8K, dequantize_row, quantize_row_q8_0, quantize_row_q8_1,
    quantize_row_q8_k,
};
use bytemuck::Zeroable;

fn lcg(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

fn unit(seed: &mut u64) -> f32 {
    (lcg(seed) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

/// An f16 scale of varied magnitude: zero, tiny (subnormal), huge, negative or ordinary.
fn scale(seed: &mut u64, extreme: bool) -> u16 {
    let v = match lcg(seed) % if extreme { 8 } else { 3 } {
        0..=2 => 0.002 + unit(seed).abs() * 0.05,
        3 => 0.0,
        4 => 6e-8,
        5 => 30000.0,
        6 => -0.04,
        _ => 1.0,
    };
    half::f16::from_f32(v).to_bits()
}

/// Random blocks of `dtype`: random bytes with scales put where the format has them. With
/// `all_max`, every quantized value is at its largest.
pub(crate) fn random_row(dtype: DType, k: usize, seed: &mut u64, extreme: bool) -> Vec<u8> {
    let bb = dtype.block_bytes();
    let mut bytes: Vec<u8> = (0..dtype.row_bytes(k)).map(|_| lcg(seed) as u8).collect();
    for blk in bytes.chunks_exact_mut(bb) {
        let all_max = extreme && lcg(seed).is_multiple_of(6);
        if all_max {
            blk.fill(0xFF);
        }
        let offsets: &[usize] = match dtype {
            DType::Q8_0 | DType::Q4_0 => &[0],
            DType::Q4_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
            DType::Q6_K => &[208],
            _ => unreachable!(),
        };
        for &off in offsets {
            blk[off..off + 2].copy_from_slice(&scale(seed, extreme).to_le_bytes());
        }
        if dtype == DType::Q6_K && all_max {
            for s in &mut blk[192..208] {
                *s = if lcg(seed).is_multiple_of(2) {
                    0x7F
                } else {
                    0x80
                };
            }
        }
        if dtype == DType::Q8_0 && lcg(seed).is_multiple_of(4) {
            blk[2] = 0x80; // -128: a value ggml never writes, which files may still hold.
        }
    }
    bytes
}

/// Activations as the kernel sees them: quantized with the public ggml-format functions,
/// then dequantized.
pub(crate) fn dequantized_activations(dtype: DType, x: &[f32]) -> Vec<f64> {
    let k = x.len();
    match dtype {
        DType::Q4_1 => {
            let mut b = vec![BlockQ8_1::zeroed(); k / 32];
            quantize_row_q8_1(x, &mut b);
            b.iter()
                .flat_map(|b| {
                    let d = half::f16::from_le_bytes(b.d).to_f64();
                    b.qs.map(|q| q as f64 * d)
                })
                .collect()
        }
        DType::Q8_0 | DType::Q4_0 => {
            let mut b = vec![BlockQ8_0::zeroed(); k / 32];
            quantize_row_q8_0(x, &mut b);
            b.iter()
                .flat_map(|b| {
                    let d = half::f16::from_le_bytes(b.d).to_f64();
                    b.qs.map(|q| q as f64 * d)
                })
                .collect()
        }
        _ => {
            let mut b = vec![BlockQ8K::zeroed(); k / 256];
            quantize_row_q8_k(x, &mut b);
            b.iter()
                .flat_map(|b| b.qs.map(|q| q as f64 * b.d as f64))
                .collect()
        }
    }
}

/// The plain reference for one output: weights dequantized to f32, activations quantized
/// and dequantized as the kernel's are, the dot in f64 (Q4_1 takes Q8_1's f16 `s` for the
/// `m` term, as llama.cpp does). Also returns a bound of the terms' sizes, for tolerances:
/// `Σ|w·x|` plus, for formats with an offset term (Q4_1's `m`, the K formats' mins), that
/// term's size (the row decoded with `d = 0`).
pub(crate) fn reference(dtype: DType, row: &[u8], x: &[f32]) -> (f64, f64) {
    let k = x.len();
    let xs = dequantized_activations(dtype, x);
    let mut wf = vec![0f32; k];
    dequantize_row(dtype, row, &mut wf);
    let mut w0 = vec![0f32; k];
    if matches!(dtype, DType::Q4_1 | DType::Q4_K | DType::Q5_K) {
        let mut zeroed = row.to_vec();
        for blk in zeroed.chunks_exact_mut(dtype.block_bytes()) {
            blk[..2].fill(0);
        }
        dequantize_row(dtype, &zeroed, &mut w0);
    }
    let mut want: f64 = (0..k).map(|p| wf[p] as f64 * xs[p]).sum();
    let size: f64 = (0..k)
        .map(|p| xs[p].abs() * (wf[p].abs() + 2.0 * w0[p].abs()) as f64)
        .sum();
    if dtype == DType::Q4_1 {
        let mut b = vec![BlockQ8_1::zeroed(); k / 32];
        quantize_row_q8_1(x, &mut b);
        for (q8, w) in b.iter().zip(row.chunks_exact(20)) {
            let m = half::f16::from_le_bytes([w[2], w[3]]).to_f64();
            let d = half::f16::from_le_bytes(q8.d).to_f64();
            let sum: f64 = q8.qs.iter().map(|&q| q as f64).sum();
            let s = half::f16::from_le_bytes(q8.s).to_f64();
            want += m * (s - d * sum);
        }
    }
    (want, size)
}

fn quantize_acts(dtype: DType, x: &[f32], m: usize, k: usize) -> (ActLayout, Vec<u64>) {
    quantize_acts_as(ActKind::for_weights(dtype), x, m, k)
}

fn quantize_acts_as(kind: ActKind, x: &[f32], m: usize, k: usize) -> (ActLayout, Vec<u64>) {
    let layout = ActLayout::new(kind, k);
    let mut buf = vec![0u64; (m * layout.stride).div_ceil(8) + 8];
    let base = buf.as_mut_ptr().cast::<u8>();
    let base = unsafe { base.add(base.align_offset(64)) };
    for i in 0..m {
        unsafe {
            quantize_activation_row(&layout, &x[i * k..(i + 1) * k], base.add(i * layout.stride))
        };
    }
    (layout, buf)
}

fn run(
    isa: QIsa,
    dtype: DType,
    w: &[u8],
    n: usize,
    acts: &[u64],
    layout: ActLayout,
    m: usize,
) -> Vec<f32> {
    run_wide(
        isa,
        dtype,
        w,
        n,
        acts,
        layout,
        m,
        wide_rows(isa, dtype, m, false),
        false,
    )
}

/// [`run`] with the wide road taking rows `0..wide`, whatever the set and batch.
#[allow(clippy::too_many_arguments)]
fn run_wide(
    isa: QIsa,
    dtype: DType,
    w: &[u8],
    n: usize,
    acts: &[u64],
    layout: ActLayout,
    m: usize,
    wide: usize,
    interleaved: bool,
) -> Vec<f32> {
    let base = acts.as_ptr().cast::<u8>();
    let base = unsafe { base.add(base.align_offset(64)) };
    let mut y = vec![f32::NAN; m * n];
    let mut tiles = vec![0u8; tiles_bytes(wide, layout.k)];
    let mut panel = vec![0u8; panel_bytes(layout.k)];
    if wide > 0 {
        unsafe {
            build_tiles(
                &layout,
                base,
                wide,
                0..wide.div_ceil(TM),
                tiles.as_mut_ptr(),
            );
        }
    }
    quant_rows(
        isa,
        dtype,
        QJob {
            w: w.as_ptr(),
            row_bytes: dtype.row_bytes(layout.k),
            n,
            rows: (0, n),
            acts: base,
            layout,
            m,
            block_rows: 8,
            y: y.as_mut_ptr(),
            wide,
            tiles: tiles.as_ptr(),
            panel: panel.as_mut_ptr(),
            // Several blocks: each weight row is unpacked more than once.
            block_tiles: 1,
            interleaved,
        },
    );
    y
}

#[test]
fn activation_rows_hold_what_the_ggml_format_functions_make() {
    let mut seed = 11u64;
    let k = 512;
    let x: Vec<f32> = (0..k).map(|_| unit(&mut seed) * 4.0).collect();
    let row_of = |buf: &Vec<u64>| unsafe {
        let p = buf.as_ptr().cast::<u8>();
        p.add(p.align_offset(64))
    };
    let (lay, buf) = quantize_acts(DType::Q8_0, &x, 1, k);
    let row = row_of(&buf);
    let mut b1 = vec![BlockQ8_1::zeroed(); k / 32];
    quantize_row_q8_1(&x, &mut b1);
    for (b, blk) in b1.iter().enumerate() {
        unsafe {
            let qs = std::slice::from_raw_parts(row.cast::<i8>().add(32 * b), 32);
            assert_eq!(qs, &blk.qs);
            assert_eq!(
                rdf32(row.add(lay.d), b),
                half::f16::from_le_bytes(blk.d).to_f32()
            );
            assert_eq!(
                rdf32(row.add(lay.b), b),
                half::f16::from_le_bytes(blk.s).to_f32()
            );
            let sum: i32 = blk.qs.iter().map(|&q| q as i32).sum();
            assert_eq!(row.add(lay.a).cast::<i32>().add(b).read(), sum);
        }
    }
    let natural = unsafe { std::slice::from_raw_parts(row.cast::<i8>(), k).to_vec() };
    // Q4_0's layout: pairs of blocks as their nibbles unpack.
    let (_, buf) = quantize_acts(DType::Q4_0, &x, 1, k);
    let inter = unsafe { std::slice::from_raw_parts(row_of(&buf).cast::<i8>(), k) };
    for (n, i) in natural.chunks(64).zip(inter.chunks(64)) {
        assert_eq!(&i[..16], &n[..16]);
        assert_eq!(&i[16..32], &n[32..48]);
        assert_eq!(&i[32..48], &n[16..32]);
        assert_eq!(&i[48..], &n[48..]);
    }
    // Q4_1's: each four blocks as their first halves, then their second halves.
    let (_, buf) = quantize_acts(DType::Q4_1, &x, 1, k);
    let inter = unsafe { std::slice::from_raw_parts(row_of(&buf).cast::<i8>(), k) };
    for (n, i) in natural.chunks(128).zip(inter.chunks(128)) {
        for b in 0..4 {
            assert_eq!(&i[16 * b..16 * b + 16], &n[32 * b..32 * b + 16]);
            assert_eq!(&i[64 + 16 * b..80 + 16 * b], &n[32 * b + 16..32 * b + 32]);
        }
    }

    let (lay, buf) = quantize_acts(DType::Q6_K, &x, 1, k);
    let row = row_of(&buf);
    let mut bk = vec![BlockQ8K::zeroed(); k / 256];
    quantize_row_q8_k(&x, &mut bk);
    for (b, blk) in bk.iter().enumerate() {
        unsafe {
            let qs = std::slice::from_raw_parts(row.cast::<i8>().add(256 * b), 256);
            assert_eq!(qs, &blk.qs);
            assert_eq!(rdf32(row.add(lay.d), b), blk.d);
            let bs = std::slice::from_raw_parts(row.add(lay.a).cast::<i16>().add(16 * b), 16);
            assert_eq!(bs, &blk.bsums);
            for t in 0..8 {
                let p = row.add(lay.b).cast::<i16>().add(8 * b + t).read();
                assert_eq!(p, blk.bsums[2 * t] + blk.bsums[2 * t + 1]);
            }
        }
    }
    // Q4_K's layout: each 128 values as sub-blocks 0, 2, 1, 3.
    let natural = unsafe { std::slice::from_raw_parts(row.cast::<i8>(), k).to_vec() };
    let (_, buf) = quantize_acts(DType::Q4_K, &x, 1, k);
    let inter = unsafe { std::slice::from_raw_parts(row_of(&buf).cast::<i8>(), k) };
    for (n, i) in natural.chunks(128).zip(inter.chunks(128)) {
        assert_eq!(&i[..32], &n[..32]);
        assert_eq!(&i[32..64], &n[64..96]);
        assert_eq!(&i[64..96], &n[32..64]);
        assert_eq!(&i[96..], &n[96..]);
    }
}

/// Every kernel, every instruction set, against `Σ dequant(w)·dequant(quant(x))` in f64;
/// every set gives the portable kernel's bits.
#[test]
fn kernels_match_f64_reference_and_agree_across_sets() {
    let dtypes = [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ];
    for dtype in dtypes {
        for &(n, blocks, m, extreme) in &[
            (1, 1, 1, false),
            (8, 2, 1, false),
            (13, 3, 5, true),
            (17, 5, 4, false),
            (9, 4, 2, true),
            (3, 1, 9, true),
            // The wide road (with VNNI): several tiles, the last one part full.
            (11, 2, 35, true),
            (16, 3, 16, false),
            (9, 1, 33, false),
        ] {
            let k = blocks * dtype.block_size();
            let mut seed = (n * 31 + k * 7 + m) as u64 + dtype.ggml_type() as u64 * 1000;
            let w: Vec<u8> = (0..n)
                .flat_map(|_| random_row(dtype, k, &mut seed, extreme))
                .collect();
            let mut x: Vec<f32> = (0..m * k).map(|_| unit(&mut seed) * 3.0).collect();
            if extreme {
                // An all-zero block and a huge one.
                x[..dtype.block_size().min(k)].fill(0.0);
                x[(m - 1) * k] = 1e4;
            }
            let (layout, acts) = quantize_acts(dtype, &x, m, k);
            let rb = dtype.row_bytes(k);
            let (want, magnitude): (Vec<f64>, Vec<f64>) = (0..m * n)
                .map(|idx| {
                    let (i, j) = (idx / n, idx % n);
                    reference(dtype, &w[j * rb..(j + 1) * rb], &x[i * k..(i + 1) * k])
                })
                .unzip();
            let portable = run(QIsa::Portable, dtype, &w, n, &acts, layout, m);
            for (idx, (&got, &want)) in portable.iter().zip(&want).enumerate() {
                let tol = 2e-6 * magnitude[idx] * (k as f64 / 32.0).sqrt() + 1e-30;
                assert!(
                    (got as f64 - want).abs() <= tol,
                    "{dtype} n={n} k={k} m={m}: y[{}, {}] = {got}, want {want} (tol {tol})",
                    idx / n,
                    idx % n
                );
            }
            for isa in QIsa::available() {
                let got = run(isa, dtype, &w, n, &acts, layout, m);
                let same = got
                    .iter()
                    .zip(&portable)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{dtype} {isa:?} n={n} k={k} m={m}: {got:?} vs portable {portable:?}"
                );
            }
        }
    }
}

/// llama.cpp's one-row Q4_K and Q6_K formulas written out plainly from the blocks' bytes (see
/// [`tile_q45k`](super::tiles) and [`tile_q6k`](super::tiles)): what every row computes.
fn one_row_formula(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let k = x.len();
    let mut xq = vec![BlockQ8K::zeroed(); k / 256];
    quantize_row_q8_k(x, &mut xq);
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    match dtype {
        DType::Q4_K => {
            let (mut acc, mut acc_min) = (0f32, 0f32);
            for (blk, xb) in row.chunks_exact(144).zip(&xq) {
                let (sc, mn) = crate::quant::scales_mins_k4(blk[4..16].try_into().unwrap());
                let (mut s, mut m) = (0i32, 0i32);
                for v in 0..256 {
                    let byte = blk[16 + 32 * (v / 64) + v % 32];
                    let q = if v % 64 < 32 { byte & 0xF } else { byte >> 4 };
                    s += sc[v / 32] as i32 * q as i32 * xb.qs[v] as i32;
                }
                for (j, &min) in mn.iter().enumerate() {
                    m += min as i32 * (xb.bsums[2 * j] as i32 + xb.bsums[2 * j + 1] as i32);
                }
                acc = (s as f32).mul_add(f16(&blk[0..2]) * xb.d, acc);
                acc_min = (m as f32).mul_add(f16(&blk[2..4]) * xb.d, acc_min);
            }
            acc - acc_min
        }
        DType::Q6_K => {
            let mut acc = [0f32; 8];
            for (blk, xb) in row.chunks_exact(210).zip(&xq) {
                let sc = |j: usize| blk[192 + j] as i8 as i32;
                let mut lanes = [0i32; 8];
                for v in 0..256 {
                    let (half, p) = (v / 128, v % 128);
                    let (ql, qh) = (&blk[64 * half..], &blk[128 + 32 * half..]);
                    let lo = if p < 64 {
                        ql[p % 64] & 0xF
                    } else {
                        ql[p % 64] >> 4
                    };
                    let hi = (qh[p % 32] >> (2 * (p / 32))) & 3;
                    let q = (lo | hi << 4) as i32;
                    lanes[(v % 32) / 4] += sc(v / 16) * q * xb.qs[v] as i32;
                }
                let d = xb.d * f16(&blk[208..210]);
                for (l, lane) in lanes.iter().enumerate() {
                    let off = xb.bsums[2 * l] as i32 * sc(2 * l)
                        + xb.bsums[2 * l + 1] as i32 * sc(2 * l + 1);
                    acc[l] = d.mul_add((lane - 32 * off) as f32, acc[l]);
                }
            }
            hsum_float_8(&acc)
        }
        _ => unreachable!(),
    }
}

#[test]
fn q4k_and_q6k_compute_llama_cpp_one_row_formulas() {
    for dtype in [DType::Q4_K, DType::Q6_K] {
        let (n, k, m) = (9, 3 * 256, 18);
        let mut seed = 77 + dtype.ggml_type() as u64;
        let w: Vec<u8> = (0..n)
            .flat_map(|_| random_row(dtype, k, &mut seed, true))
            .collect();
        let x: Vec<f32> = (0..m * k).map(|_| unit(&mut seed) * 3.0).collect();
        let (layout, acts) = quantize_acts(dtype, &x, m, k);
        let rb = dtype.row_bytes(k);
        for isa in QIsa::available() {
            let got = run(isa, dtype, &w, n, &acts, layout, m);
            for i in 0..m {
                for j in 0..n {
                    let want = one_row_formula(dtype, &w[j * rb..(j + 1) * rb], &x[i * k..][..k]);
                    assert_eq!(
                        got[i * n + j].to_bits(),
                        want.to_bits(),
                        "{dtype} {isa:?}: y[{i}, {j}] = {}, want {want}",
                        got[i * n + j]
                    );
                }
            }
        }
    }
}

/// A row gives the same bits alone, and at every place of every batch of 2 to 20 rows (tiles
/// of four, the last rows alone, the wide road's tiles from 16 rows with VNNI), on every
/// instruction set, and the same bits on every set; and so does the wide road (Q4_K, Q6_K)
/// forced on every set and batch size, one or two tiles, the last part full.
#[test]
fn every_row_gives_its_bits_alone_in_any_batch() {
    const ROWS: usize = 20;
    for dtype in [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ] {
        // 32-value blocks: 7 (a group of four, a pair and one alone for Q4_1); K: 3.
        let k = if dtype.block_size() == 32 {
            7 * 32
        } else {
            3 * 256
        };
        let n = 11;
        let mut seed = 5 + dtype.ggml_type() as u64;
        let w: Vec<u8> = (0..n)
            .flat_map(|_| random_row(dtype, k, &mut seed, true))
            .collect();
        let x: Vec<f32> = (0..ROWS * k).map(|_| unit(&mut seed) * 3.0).collect();
        let row = |i: usize| &x[i * k..(i + 1) * k];
        let alone: Vec<Vec<f32>> = (0..ROWS)
            .map(|i| {
                let (layout, acts) = quantize_acts(dtype, row(i), 1, k);
                run(QIsa::Portable, dtype, &w, n, &acts, layout, 1)
            })
            .collect();
        for isa in QIsa::available() {
            for m in 1..=ROWS {
                // Batches of `m` consecutive rows (cyclically), starting at every row: each
                // row at every place of the batch.
                for start in 0..ROWS {
                    let ids: Vec<usize> = (0..m).map(|j| (start + j) % ROWS).collect();
                    let xs: Vec<f32> = ids.iter().flat_map(|&i| row(i).iter().copied()).collect();
                    let (layout, acts) = quantize_acts(dtype, &xs, m, k);
                    let mut roads = vec![(wide_rows(isa, dtype, m, false), "")];
                    if matches!(dtype, DType::Q4_K | DType::Q6_K) {
                        // The wide road, which only VNNI takes from 16 rows on, forced.
                        roads.push((m, " (wide road forced)"));
                        roads.push((m / 2, " (half on the wide road)"));
                    }
                    for (wide, how) in roads {
                        let got = run_wide(isa, dtype, &w, n, &acts, layout, m, wide, false);
                        for (place, &i) in ids.iter().enumerate() {
                            let same = got[place * n..(place + 1) * n]
                                .iter()
                                .zip(&alone[i])
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(
                                same,
                                "{dtype} {isa:?}{how}: row {i} at place {place} of {m} (wide \
                                 rows {wide}) differs from the row alone"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Q4_K, Q5_K, Q8_0, Q4_0, Q4_1 and Q6_K rows interleaved sixteen at a time convert back to
/// their plain bytes, and give every product the bits of the plain rows: on every instruction
/// set (the VNNI kernel, the AVX2 one or the portable one), for batches of 1 to 20 rows, some
/// or all of them on the wide road.
#[test]
fn interleaved_rows_give_the_bits_of_plain_ones() {
    for dtype in [
        DType::Q4_K,
        DType::Q5_K,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q6_K,
    ] {
        // 32-value blocks: an odd count, a last block unpaired (Q8_0's and Q4_0's layouts pair
        // them).
        let k = if dtype.block_size() == 32 {
            25 * 32
        } else {
            3 * 256
        };
        let (n, rows) = (2 * X16, 20);
        let row_bytes = dtype.row_bytes(k);
        let mut seed = 99;
        let w: Vec<u8> = (0..n)
            .flat_map(|_| random_row(dtype, k, &mut seed, true))
            .collect();
        let mut inter = vec![0u8; w.len()];
        interleave(dtype, &w, n, k, &mut inter);
        for row in 0..n {
            let group = &inter[row / X16 * X16 * row_bytes..][..X16 * row_bytes];
            let mut back = vec![0u8; row_bytes];
            plain_row(dtype, group, k, row % X16, &mut back);
            assert_eq!(back, w[row * row_bytes..][..row_bytes], "{dtype} row {row}");
        }
        let x: Vec<f32> = (0..rows * k).map(|_| unit(&mut seed) * 3.0).collect();
        for m in 1..=rows {
            let (layout, acts) = quantize_acts(dtype, &x, m, k);
            let want = run(QIsa::Portable, dtype, &w, n, &acts, layout, m);
            let (layout, acts) = quantize_acts_as(ActKind::for_interleaved(dtype), &x, m, k);
            for isa in QIsa::available() {
                let mut roads = vec![wide_rows(isa, dtype, m, true)];
                if matches!(dtype, DType::Q4_K | DType::Q6_K) {
                    // The wide road over interleaved rows, forced.
                    roads.extend([m, m / 2]);
                }
                for wide in roads {
                    let got = run_wide(isa, dtype, &inter, n, &acts, layout, m, wide, true);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{dtype} {isa:?}: {m} rows, {wide} on the wide road");
                }
            }
        }
    }
}
