//! Matrix products: the decode matrix-vector kernels (plain and fused with the norm and
//! their epilogues), cuBLASLt's GEMM and the batch-invariant one.

use super::*;

/// `y = W·x (+ y)` in f64 from the weights as stored.
fn matvec_reference(
    w: &[f32],
    x: &[f32],
    y0: Option<&[f32]>,
    rows: usize,
    cols: usize,
) -> Vec<f64> {
    let batch = x.len() / cols;
    let mut y = vec![0f64; batch * rows];
    for b in 0..batch {
        for r in 0..rows {
            let dot: f64 = (0..cols)
                .map(|c| w[r * cols + c] as f64 * x[b * cols + c] as f64)
                .sum();
            y[b * rows + r] = dot + y0.map_or(0.0, |y0| y0[b * rows + r] as f64);
        }
    }
    y
}

fn check_matvec<T: Elem>(ctx: &Ctx, rng: &mut Rng, rows: usize, cols: usize, batch: usize) {
    let w: Vec<T> = round(&rng.vec(rows * cols));
    let x = rng.vec(batch * cols);
    let wbuf = ctx.upload(&w);
    let xbuf = ctx.upload(&x);
    let mat = DevMat::from_slice(wbuf.as_slice::<T>(), rows, cols).unwrap();
    let wf = widen(&w);

    let mut y = ctx.poisoned::<f32>(batch * rows);
    cuda::matvec(
        &ctx.device,
        &mat,
        xbuf.as_slice(),
        batch,
        &mut y.as_mut_slice(),
        false,
    )
    .unwrap();
    let got = ctx.download::<f32>(&y);
    let err = rel_err(&got, &matvec_reference(&wf, &x, None, rows, cols));
    assert!(
        err < 1e-5,
        "matvec {} {rows}×{cols} batch {batch}: error {err:e}",
        T::FLOAT
    );

    // Accumulating into what is there.
    let y0 = rng.vec(batch * rows);
    let mut y = ctx.upload(&y0);
    cuda::matvec(
        &ctx.device,
        &mat,
        xbuf.as_slice(),
        batch,
        &mut y.as_mut_slice(),
        true,
    )
    .unwrap();
    let err = rel_err(
        &ctx.download::<f32>(&y),
        &matvec_reference(&wf, &x, Some(&y0), rows, cols),
    );
    assert!(err < 1e-5, "accumulating matvec: error {err:e}");
}

#[test]
fn matvec_matches_f64_reference() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(1);
    // Vectorised (cols a multiple of 8) and scalar (odd cols) paths, 1 to 8 warps sharing a
    // row (short to long rows), odd row counts, every batch size.
    for (rows, cols) in [(37, 13), (75, 256), (65, 2048), (1001, 1032), (4096, 4096)] {
        for batch in [1, 2, 3, 5, 8] {
            check_matvec::<bf16>(&ctx, &mut rng, rows, cols, batch);
        }
        check_matvec::<f16>(&ctx, &mut rng, rows, cols, 1);
        check_matvec::<f16>(&ctx, &mut rng, rows, cols, 4);
        check_matvec::<f32>(&ctx, &mut rng, rows, cols, 1);
        check_matvec::<f32>(&ctx, &mut rng, rows, cols, 7);
    }
    for batch in [4, 6, 7] {
        check_matvec::<bf16>(&ctx, &mut rng, 129, 520, batch);
    }
    // Long rows, whole and odd (8 warps a row, some lanes a step short), at batch 1.
    for (rows, cols) in [(300, 12288), (77, 5000), (41, 40000)] {
        check_matvec::<bf16>(&ctx, &mut rng, rows, cols, 1);
        check_matvec::<f32>(&ctx, &mut rng, rows, cols, 1);
    }
    // Longer batches: whole blocks of 8 rows in one launch, then the rest.
    for batch in [13, 16, 21] {
        check_matvec::<bf16>(&ctx, &mut rng, 129, 520, batch);
        check_matvec::<f32>(&ctx, &mut rng, 65, 2048, batch);
    }
}

/// `rms_norm(x[b]) · g` in f64.
fn normed_reference(x: &[f32], g: &[f32], eps: f64) -> Vec<f32> {
    let cols = g.len();
    x.chunks(cols)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
            let s = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(g)
                .map(move |(&v, &g)| (v as f64 * s * g as f64) as f32)
        })
        .collect()
}

/// One launch for q, k and v with the RMS norm inside (and biases), and for gate and up with
/// SwiGLU after: each output as the unfused steps give it.
///
/// `scale` multiplies the row counts (many blocks, groups straddling matrices far in).
fn check_fused_matvec<T: Elem>(ctx: &Ctx, rng: &mut Rng, cols: usize, batch: usize, scale: usize) {
    let eps = 1e-6;
    let (x, g) = (rng.vec(batch * cols), rng.vec(cols));
    let (xbuf, gbuf) = (ctx.upload(&x), ctx.upload(&g));
    let normed = normed_reference(&x, &g, eps as f64);
    let norm = MatvecNorm {
        weight: gbuf.as_slice(),
        eps,
    };
    // Row counts that leave groups straddling two matrices.
    let shapes = [37 * scale, 11 * scale, 11 * scale];
    let ws: Vec<Vec<T>> = shapes.iter().map(|&r| round(&rng.vec(r * cols))).collect();
    let biases: Vec<Option<Vec<f32>>> =
        vec![Some(rng.vec(shapes[0])), None, Some(rng.vec(shapes[2]))];
    let wbufs: Vec<DeviceBuffer> = ws.iter().map(|w| ctx.upload(w)).collect();
    let bbufs: Vec<Option<DeviceBuffer>> = biases
        .iter()
        .map(|b| b.as_ref().map(|b| ctx.upload(b)))
        .collect();
    let mats: Vec<DevMat<'_>> = wbufs
        .iter()
        .zip(shapes)
        .map(|(w, rows)| DevMat::from_slice(w.as_slice::<T>(), rows, cols).unwrap())
        .collect();
    let mut ys: Vec<DeviceBuffer> = shapes
        .iter()
        .map(|&r| ctx.poisoned::<f32>(batch * r))
        .collect();
    let mut outputs: Vec<MatvecOutput<'_, '_>> = mats
        .iter()
        .zip(&bbufs)
        .zip(&mut ys)
        .map(|((w, b), y)| MatvecOutput {
            w,
            bias: b.as_ref().map(|b| b.as_slice()),
            y: y.as_mut_slice(),
        })
        .collect();
    cuda::matvec_fused(
        &ctx.device,
        &mut outputs,
        xbuf.as_slice(),
        batch,
        Some(norm),
        Epilogue::Store,
    )
    .unwrap();
    drop(outputs);
    for (i, &rows) in shapes.iter().enumerate() {
        let mut want = matvec_reference(&widen(&ws[i]), &normed, None, rows, cols);
        if let Some(b) = &biases[i] {
            for (k, v) in want.iter_mut().enumerate() {
                *v += b[k % rows] as f64;
            }
        }
        let err = rel_err(&ctx.download::<f32>(&ys[i]), &want);
        assert!(
            err < 1e-5,
            "fused matvec {} output {i} of {cols} cols, batch {batch}: error {err:e}",
            T::FLOAT
        );
    }

    // SwiGLU over gate and up.
    let rows = 45 * scale;
    let (gate, up): (Vec<T>, Vec<T>) = (round(&rng.vec(rows * cols)), round(&rng.vec(rows * cols)));
    let (gbuf_w, ubuf_w) = (ctx.upload(&gate), ctx.upload(&up));
    let gm = DevMat::from_slice(gbuf_w.as_slice::<T>(), rows, cols).unwrap();
    let um = DevMat::from_slice(ubuf_w.as_slice::<T>(), rows, cols).unwrap();
    let (mut gy, mut uy) = (
        ctx.poisoned::<f32>(batch * rows),
        ctx.poisoned::<f32>(batch * rows),
    );
    let mut outputs = [
        MatvecOutput {
            w: &gm,
            bias: None,
            y: gy.as_mut_slice(),
        },
        MatvecOutput {
            w: &um,
            bias: None,
            y: uy.as_mut_slice(),
        },
    ];
    cuda::matvec_fused(
        &ctx.device,
        &mut outputs,
        xbuf.as_slice(),
        batch,
        Some(norm),
        Epilogue::SwiGlu,
    )
    .unwrap();
    let gs = matvec_reference(&widen(&gate), &normed, None, rows, cols);
    let us = matvec_reference(&widen(&up), &normed, None, rows, cols);
    let want: Vec<f64> = gs
        .iter()
        .zip(&us)
        .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    let err = rel_err(&ctx.download::<f32>(&gy), &want);
    assert!(
        err < 1e-5,
        "SwiGLU matvec {} of {cols} cols, batch {batch}: error {err:e}",
        T::FLOAT
    );
}

#[test]
fn fused_matvec_matches_the_unfused_steps() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(11);
    // Scalar (odd) and vectorised columns, short and long rows.
    for cols in [13, 256, 1032, 4096] {
        for batch in [1, 3, 8] {
            check_fused_matvec::<bf16>(&ctx, &mut rng, cols, batch, 1);
        }
        check_fused_matvec::<f32>(&ctx, &mut rng, cols, 2, 1);
        check_fused_matvec::<f16>(&ctx, &mut rng, cols, 5, 1);
    }
    // Thousands of rows, short and long.
    for cols in [1024, 4096, 12288] {
        check_fused_matvec::<bf16>(&ctx, &mut rng, cols, 1, 64);
        check_fused_matvec::<bf16>(&ctx, &mut rng, cols, 2, 64);
    }
}

/// The two products of 16-bit activations and weights: cuBLASLt's and the batch-invariant one.
trait Product {
    fn run<I: FloatElem, O: FloatElem>(
        &mut self,
        a: cuda::DevSlice<'_, I>,
        w: &DevMat<'_>,
        out: &mut cuda::DevSliceMut<'_, O>,
        accumulate: bool,
    ) -> Result<(), CudaError>;
}

macro_rules! product {
    ($gemm:ty) => {
        impl Product for $gemm {
            fn run<I: FloatElem, O: FloatElem>(
                &mut self,
                a: cuda::DevSlice<'_, I>,
                w: &DevMat<'_>,
                out: &mut cuda::DevSliceMut<'_, O>,
                accumulate: bool,
            ) -> Result<(), CudaError> {
                self.matmul(a, w, out, accumulate)
            }
        }
    };
}
product!(Gemm);
product!(SlicedGemm);

fn check_gemm<I: Elem, O: Elem + Default>(
    ctx: &Ctx,
    gemm: &mut impl Product,
    rng: &mut Rng,
    m: usize,
    n: usize,
    k: usize,
) {
    let a: Vec<I> = round(&rng.vec(m * k));
    let w: Vec<I> = round(&rng.vec(n * k));
    let (abuf, wbuf) = (ctx.upload(&a), ctx.upload(&w));
    let mat = DevMat::from_slice(wbuf.as_slice::<I>(), n, k).unwrap();
    let (af, wf) = (widen(&a), widen(&w));
    // out = a·Wᵀ is m matvecs of W.
    let want = matvec_reference(&wf, &af, None, n, k);
    let mut out = ctx.poisoned::<O>(m * n);
    gemm.run(
        abuf.as_slice::<I>(),
        &mat,
        &mut out.as_mut_slice::<O>(),
        false,
    )
    .unwrap();
    let got = widen(&ctx.download::<O>(&out));
    let tolerance = if O::FLOAT == cuda::Float::F32 {
        1e-5
    } else {
        4e-3
    };
    let err = rel_err(&got, &want);
    assert!(
        err < tolerance,
        "gemm {m}×{n}×{k} of {} into {}: error {err:e}",
        I::FLOAT,
        O::FLOAT
    );

    let c0: Vec<O> = round(&rng.vec(m * n));
    let mut out = ctx.upload(&c0);
    gemm.run(
        abuf.as_slice::<I>(),
        &mat,
        &mut out.as_mut_slice::<O>(),
        true,
    )
    .unwrap();
    let want: Vec<f64> = want
        .iter()
        .zip(widen(&c0))
        .map(|(w, c)| w + c as f64)
        .collect();
    let err = rel_err(&widen(&ctx.download::<O>(&out)), &want);
    assert!(err < tolerance, "accumulating gemm: error {err:e}");
}

#[test]
fn gemm_matches_f64_reference() {
    let Some(ctx) = Ctx::new() else { return };
    let mut gemm = Gemm::new(&ctx.device, &ctx.owner).unwrap();
    let mut sliced = SlicedGemm::new(&ctx.device, &ctx.owner).unwrap();
    let mut rng = Rng(2);
    for (m, n, k) in [(37, 72, 136), (64, 256, 512), (300, 1000, 1024), (5, 8, 8)] {
        check_gemm::<bf16, f32>(&ctx, &mut gemm, &mut rng, m, n, k);
        check_gemm::<bf16, bf16>(&ctx, &mut gemm, &mut rng, m, n, k);
    }
    // The batch-invariant product: every tile, split or not, k not a multiple of a step.
    for (m, n, k) in [
        (1, 72, 136),
        (37, 72, 136),
        (64, 256, 512),
        (300, 1000, 1024),
        (5, 8, 8),
        (1, 4096, 1024),
        (700, 200, 4104),
    ] {
        check_gemm::<bf16, f32>(&ctx, &mut sliced, &mut rng, m, n, k);
        check_gemm::<bf16, bf16>(&ctx, &mut sliced, &mut rng, m, n, k);
        check_gemm::<f16, f32>(&ctx, &mut sliced, &mut rng, m, n, k);
    }
    // Each tile the device runs, forced, its slices summed in one block and split: edges of
    // rows, tokens and values inside a tile.
    for tile in sliced.tiles() {
        for split in [false, true].into_iter().filter(|&s| !s || tile.splits()) {
            sliced.force_tile(Some((tile, split)));
            for (m, n, k) in [(37, 72, 136), (300, 200, 4104)] {
                check_gemm::<bf16, f32>(&ctx, &mut sliced, &mut rng, m, n, k);
                check_gemm::<f16, bf16>(&ctx, &mut sliced, &mut rng, m, n, k);
            }
        }
    }
}

/// A row of the batch-invariant product is the same bits whatever batch it comes in: every
/// tile, slices split across blocks or summed in one, a batch of one or of 1200.
#[test]
fn sliced_gemm_gives_a_row_the_same_bits_in_every_batch() {
    let Some(ctx) = Ctx::new() else { return };
    let mut sliced = SlicedGemm::new(&ctx.device, &ctx.owner).unwrap();
    let mut rng = Rng(21);
    // 4096 rows of 1024 take slices of 128: 8 of them, split in blocks up to 128 tokens.
    let (n, k, most) = (4096, 1024, 1200);
    let a: Vec<bf16> = round(&rng.vec(most * k));
    let w: Vec<bf16> = round(&rng.vec(n * k));
    let (abuf, wbuf) = (ctx.upload(&a), ctx.upload(&w));
    let mat = DevMat::from_slice(wbuf.as_slice::<bf16>(), n, k).unwrap();
    let run = |sliced: &mut SlicedGemm, first: usize, m: usize| -> Vec<u32> {
        let mut out = ctx.poisoned::<f32>(m * n);
        let x = abuf.as_slice::<bf16>().slice(first * k..(first + m) * k);
        sliced
            .matmul(x, &mat, &mut out.as_mut_slice::<f32>(), false)
            .unwrap();
        bits(&ctx.download::<f32>(&out))
    };
    let all = run(&mut sliced, 0, most);
    for (first, m) in [
        (0, 1),
        (5, 1),
        (1199, 1),
        (0, 3),
        (2, 8),
        (1, 9),
        (7, 32),
        (0, 40),
        (3, 64),
        (0, 65),
        (100, 600),
    ] {
        let got = run(&mut sliced, first, m);
        assert!(
            got == all[first * n..(first + m) * n],
            "rows {first}..{} alone differ from the same rows in a batch of {most}",
            first + m
        );
    }
    // Every tile, its slices split across blocks or summed in one, whatever the batch.
    for tile in sliced.tiles() {
        for split in [false, true].into_iter().filter(|&s| !s || tile.splits()) {
            sliced.force_tile(Some((tile, split)));
            for (first, m) in [(0, 1), (3, 64), (100, 300)] {
                let got = run(&mut sliced, first, m);
                assert!(
                    got == all[first * n..(first + m) * n],
                    "rows {first}..{} by {} (split {split}) differ from the planned batch of \
                     {most}",
                    first + m,
                    tile.name()
                );
            }
        }
    }
}

/// Tiles timed on the device change which kernel runs, never a result: after tuning, every
/// batch gives the bits of the built-in plan, and each tuned batch has a choice.
#[test]
fn sliced_gemm_tuned_plans_keep_the_bits() {
    let Some(ctx) = Ctx::new() else { return };
    let mut sliced = SlicedGemm::new(&ctx.device, &ctx.owner).unwrap();
    let mut rng = Rng(22);
    let (n, k, most) = (2048, 1024, 300);
    let a: Vec<bf16> = round(&rng.vec(most * k));
    let (w1, w2): (Vec<bf16>, Vec<bf16>) = (round(&rng.vec(n * k)), round(&rng.vec(n * k)));
    let (abuf, b1, b2) = (ctx.upload(&a), ctx.upload(&w1), ctx.upload(&w2));
    let mat1 = DevMat::from_slice(b1.as_slice::<bf16>(), n, k).unwrap();
    let mat2 = DevMat::from_slice(b2.as_slice::<bf16>(), n, k).unwrap();
    let run = |sliced: &mut SlicedGemm, m: usize| -> Vec<u32> {
        let mut out = ctx.poisoned::<f32>(m * n);
        let x = abuf.as_slice::<bf16>().slice(0..m * k);
        sliced
            .matmul(x, &mat1, &mut out.as_mut_slice::<f32>(), false)
            .unwrap();
        bits(&ctx.download::<f32>(&out))
    };
    let batches = [1, 3, 40, 300];
    let planned: Vec<Vec<u32>> = batches.iter().map(|&m| run(&mut sliced, m)).collect();
    let mut out = ctx.poisoned::<f32>(most * n);
    let tuned = sliced
        .tune(
            &[mat1, mat2],
            abuf.as_slice::<bf16>(),
            &mut out.as_mut_slice::<f32>(),
            &[1, 4, 64, most],
        )
        .unwrap();
    assert_eq!(
        tuned.iter().map(|t| t.most_rows).collect::<Vec<_>>(),
        [1, 4, 64, most]
    );
    assert!(tuned.iter().all(|t| (t.n, t.k) == (n, k) && t.us > 0.0));
    for (m, want) in batches.iter().zip(&planned) {
        assert!(
            run(&mut sliced, *m) == *want,
            "{m} rows after tuning ({tuned:?}) differ from the built-in plan's"
        );
    }
}

/// Matrices stacked end to end (q, k and v) in one launch, each into its own output: every
/// output element the same bits as the stacked matrix's product into one output, for a
/// batch whose slices run in blocks of their own and one whose slices do not, accumulating
/// or not.
#[test]
fn sliced_gemm_parts_are_the_columns_of_the_stacked_product() {
    let Some(ctx) = Ctx::new() else { return };
    let mut sliced = SlicedGemm::new(&ctx.device, &ctx.owner).unwrap();
    let mut rng = Rng(23);
    let (parts, k) = ([136, 40, 40], 520);
    let n: usize = parts.iter().sum();
    let w: Vec<bf16> = round(&rng.vec(n * k));
    let wbuf = ctx.upload(&w);
    let mat = DevMat::from_slice(wbuf.as_slice::<bf16>(), n, k).unwrap();
    for m in [1, 3, 300] {
        let a: Vec<bf16> = round(&rng.vec(m * k));
        let abuf = ctx.upload(&a);
        for accumulate in [false, true] {
            let start: Vec<f32> = rng.vec(m * n);
            let mut whole = ctx.upload(&start);
            sliced
                .matmul(
                    abuf.as_slice::<bf16>(),
                    &mat,
                    &mut whole.as_mut_slice::<f32>(),
                    accumulate,
                )
                .unwrap();
            let whole = bits(&ctx.download::<f32>(&whole));
            // The same starting values, cut into the parts' columns.
            let mut bufs: Vec<_> = (0..parts.len())
                .map(|i| {
                    let first: usize = parts[..i].iter().sum();
                    let cols: Vec<f32> = (0..m)
                        .flat_map(|t| start[t * n + first..t * n + first + parts[i]].to_vec())
                        .collect();
                    ctx.upload(&cols)
                })
                .collect();
            let mut outs: Vec<_> = bufs.iter_mut().map(|b| b.as_mut_slice::<f32>()).collect();
            sliced
                .matmul_parts(abuf.as_slice::<bf16>(), &mat, &mut outs, &parts, accumulate)
                .unwrap();
            drop(outs);
            for (i, buf) in bufs.iter().enumerate() {
                let first: usize = parts[..i].iter().sum();
                let got = bits(&ctx.download::<f32>(buf));
                for t in 0..m {
                    assert!(
                        got[t * parts[i]..(t + 1) * parts[i]]
                            == whole[t * n + first..t * n + first + parts[i]],
                        "batch {m} (accumulate {accumulate}): row {t} of output {i} differs"
                    );
                }
            }
        }
    }
    // Outputs that do not add up to the matrix are refused.
    let a: Vec<bf16> = round(&rng.vec(k));
    let abuf = ctx.upload(&a);
    let mut y = ctx.poisoned::<f32>(n);
    let e = sliced
        .matmul_parts(
            abuf.as_slice::<bf16>(),
            &mat,
            &mut [y.as_mut_slice::<f32>()],
            &[n - 1],
            false,
        )
        .unwrap_err();
    assert!(e.to_string().contains("rows"), "{e}");
}
