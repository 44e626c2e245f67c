//! Norms, rotary embeddings, elementwise ops, conversions, the embedding gather and argmax.

use super::*;

#[test]
fn rms_norm_matches_cpu() {
    let Some(ctx) = Ctx::new() else { return };
    let pool = ThreadPool::new(1);
    let mut rng = Rng(3);
    for (rows, d) in [(5, 1000), (3, 4096), (1, 13)] {
        let x = rng.vec(rows * d);
        let add = rng.vec(rows * d);
        let w = rng.vec(d);
        let eps = 1e-6;
        let (xbuf, wbuf) = (ctx.upload(&x), ctx.upload(&w));
        let mut want = vec![0f32; rows * d];
        cpu::rms_norm(&pool, &x, &w, eps, &mut want);
        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();

        let mut out = ctx.poisoned::<f32>(rows * d);
        cuda::rms_norm(
            &ctx.device,
            xbuf.as_slice(),
            wbuf.as_slice(),
            eps,
            &mut out.as_mut_slice::<f32>(),
        )
        .unwrap();
        let err = rel_err(&ctx.download::<f32>(&out), &want64);
        assert!(err < 1e-5, "rms_norm {rows}×{d}: error {err:e}");

        let mut out16 = ctx.poisoned::<bf16>(rows * d);
        cuda::rms_norm(
            &ctx.device,
            xbuf.as_slice(),
            wbuf.as_slice(),
            eps,
            &mut out16.as_mut_slice::<bf16>(),
        )
        .unwrap();
        let err = rel_err(&widen(&ctx.download::<bf16>(&out16)), &want64);
        assert!(err < 4e-3, "rms_norm to bf16: error {err:e}");

        let mut inplace = ctx.upload(&x);
        cuda::rms_norm_in_place(
            &ctx.device,
            &mut inplace.as_mut_slice(),
            wbuf.as_slice(),
            eps,
        )
        .unwrap();
        let err = rel_err(&ctx.download::<f32>(&inplace), &want64);
        assert!(err < 1e-5, "rms_norm in place: error {err:e}");

        // Fused residual add: x becomes x + add, out its norm.
        let mut xs = ctx.upload(&x);
        let addbuf = ctx.upload(&add);
        let mut out = ctx.poisoned::<f32>(rows * d);
        cuda::add_rms_norm(
            &ctx.device,
            &mut xs.as_mut_slice(),
            addbuf.as_slice(),
            wbuf.as_slice(),
            eps,
            &mut out.as_mut_slice::<f32>(),
        )
        .unwrap();
        let sum: Vec<f32> = x.iter().zip(&add).map(|(a, b)| a + b).collect();
        assert_eq!(ctx.download::<f32>(&xs), sum, "the residual add is exact");
        cpu::rms_norm(&pool, &sum, &w, eps, &mut want);
        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        let err = rel_err(&ctx.download::<f32>(&out), &want64);
        assert!(err < 1e-5, "add_rms_norm: error {err:e}");
    }
}

/// A row's norm is the same bits whatever rows share the launch and wherever the row lies
/// (an unaligned row loads its groups of four one value at a time): batch invariance.
#[test]
fn rms_norm_of_a_row_is_the_same_bits_alone_among_64_and_unaligned() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(5);
    for d in [4096, 1000, 13] {
        let rows = 64;
        let x = rng.vec(rows * d);
        let add = rng.vec(rows * d);
        let w = rng.vec(d);
        let wbuf = ctx.upload(&w);
        let fused = |x: &[f32], add: &[f32], offset: usize| {
            let pad = vec![0.5f32; offset];
            let (xs, adds) = ([&pad[..], x].concat(), [&pad[..], add].concat());
            let (mut xbuf, abuf) = (ctx.upload(&xs), ctx.upload(&adds));
            let mut out = ctx.poisoned::<bf16>(xs.len());
            let n = xs.len();
            cuda::add_rms_norm(
                &ctx.device,
                &mut xbuf.as_mut_slice::<f32>().slice_mut(offset..n),
                abuf.as_slice::<f32>().slice(offset..n),
                wbuf.as_slice(),
                1e-6,
                &mut out.as_mut_slice::<bf16>().slice_mut(offset..n),
            )
            .unwrap();
            let out = ctx.download::<bf16>(&out);
            let sum = ctx.download::<f32>(&xbuf);
            (sum[offset..].to_vec(), out[offset..].to_vec())
        };
        let (all_sum, all_out) = fused(&x, &add, 0);
        for row in [0, 37, rows - 1] {
            let r = row * d..(row + 1) * d;
            for offset in [0, 1] {
                let (sum, out) = fused(&x[r.clone()], &add[r.clone()], offset);
                assert_eq!(
                    sum,
                    all_sum[r.clone()],
                    "d {d} row {row} offset {offset}: x + add"
                );
                let same = out
                    .iter()
                    .zip(&all_out[r.clone()])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "d {d} row {row} offset {offset}: its norm differs from among {rows}"
                );
            }
        }
    }
}

#[test]
fn rope_matches_cpu_in_both_layouts_with_and_without_the_head_norm() {
    let Some(ctx) = Ctx::new() else { return };
    let pool = ThreadPool::new(1);
    let mut rng = Rng(4);
    for (n_heads, head_dim) in [(3, 64), (5, 128), (2, 20)] {
        let (rows, pos0, positions) = (7, 5, 40);
        let (cos, sin) = rope_tables(positions, head_dim, 1e6);
        let (cbuf, sbuf) = (ctx.upload(&cos), ctx.upload(&sin));
        let norm_w = rng.vec(head_dim);
        let nbuf = ctx.upload(&norm_w);
        for layout in [RopeLayout::Halves, RopeLayout::Pairs] {
            for with_norm in [false, true] {
                let x = rng.vec(rows * n_heads * head_dim);
                let mut want = x.clone();
                if with_norm {
                    cpu::rms_norm_in_place(&pool, &mut want, &norm_w, 1e-6);
                }
                let tables = RopeTables {
                    cos: &cos,
                    sin: &sin,
                    layout,
                    // transformers' rotation, which the CUDA kernel computes.
                    fused: false,
                };
                cpu::rope_in_place(&pool, &mut want, n_heads, head_dim, pos0, tables);
                let norm = with_norm.then(|| RopeNorm {
                    weight: nbuf.as_slice(),
                    eps: 1e-6,
                });
                // The position known on the host, and read on the device (a graph's step).
                let pos_buf = ctx.upload(&[pos0 as i32]);
                let mut results = Vec::new();
                for pos in [Position::Host(pos0), Position::Device(pos_buf.as_slice())] {
                    let mut xbuf = ctx.upload(&x);
                    cuda::rope(
                        &ctx.device,
                        &mut xbuf.as_mut_slice(),
                        n_heads,
                        head_dim,
                        pos,
                        cbuf.as_slice(),
                        sbuf.as_slice(),
                        layout,
                        norm,
                    )
                    .unwrap();
                    results.push(ctx.download::<f32>(&xbuf));
                }
                let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
                let err = max_abs_err(&results[0], &want64);
                assert!(
                    err < 1e-5,
                    "rope {layout:?} norm {with_norm} {n_heads}×{head_dim}: error {err:e}"
                );
                assert!(
                    bits(&results[0]) == bits(&results[1]),
                    "rope {layout:?} norm {with_norm}: a device position changed the result"
                );

                // Queries and keys in one launch: each as its own launch gives it.
                let (kv_heads, kx) = (1, rng.vec(rows * head_dim));
                let mut kbuf_alone = ctx.upload(&kx);
                cuda::rope(
                    &ctx.device,
                    &mut kbuf_alone.as_mut_slice(),
                    kv_heads,
                    head_dim,
                    Position::Host(pos0),
                    cbuf.as_slice(),
                    sbuf.as_slice(),
                    layout,
                    norm,
                )
                .unwrap();
                let (mut qbuf, mut kbuf) = (ctx.upload(&x), ctx.upload(&kx));
                cuda::rope_qk(
                    &ctx.device,
                    RopeHeads {
                        x: qbuf.as_mut_slice(),
                        n_heads,
                        norm,
                    },
                    Some(RopeHeads {
                        x: kbuf.as_mut_slice(),
                        n_heads: kv_heads,
                        norm,
                    }),
                    head_dim,
                    Position::Device(pos_buf.as_slice()),
                    cbuf.as_slice(),
                    sbuf.as_slice(),
                    layout,
                )
                .unwrap();
                assert!(bits(&ctx.download::<f32>(&qbuf)) == bits(&results[0]));
                assert!(
                    bits(&ctx.download::<f32>(&kbuf)) == bits(&ctx.download::<f32>(&kbuf_alone))
                );
            }
        }
    }
}

#[test]
fn silu_mul_add_and_convert() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(5);
    let n = 1_000_003;
    let gate: Vec<f32> = rng.vec(n).iter().map(|v| v * 8.0).collect();
    let up = rng.vec(n);
    let (gbuf, ubuf) = (ctx.upload(&gate), ctx.upload(&up));
    let want: Vec<f64> = gate
        .iter()
        .zip(&up)
        .map(|(&g, &u)| g as f64 / (1.0 + (-g as f64).exp()) * u as f64)
        .collect();
    let mut out = ctx.poisoned::<f32>(n);
    cuda::silu_mul(
        &ctx.device,
        gbuf.as_slice::<f32>(),
        ubuf.as_slice::<f32>(),
        &mut out.as_mut_slice::<f32>(),
    )
    .unwrap();
    let err = rel_err(&ctx.download::<f32>(&out), &want);
    assert!(err < 1e-6, "silu_mul: error {err:e}");
    let mut out16 = ctx.poisoned::<bf16>(n);
    cuda::silu_mul(
        &ctx.device,
        gbuf.as_slice::<f32>(),
        ubuf.as_slice::<f32>(),
        &mut out16.as_mut_slice::<bf16>(),
    )
    .unwrap();
    let err = rel_err(&widen(&ctx.download::<bf16>(&out16)), &want);
    assert!(err < 4e-3, "silu_mul to bf16: error {err:e}");
    // bf16 inputs (a prompt's gate/up GEMM outputs), on 16 bytes and off them (one by one).
    let (gate16, up16) = (round::<bf16>(&gate), round::<bf16>(&up));
    let want16: Vec<f64> = widen(&gate16)
        .iter()
        .zip(widen(&up16))
        .map(|(&g, u)| g as f64 / (1.0 + (-g as f64).exp()) * u as f64)
        .collect();
    let (g16, u16) = (ctx.upload(&gate16), ctx.upload(&up16));
    for first in [0, 1] {
        let mut out = ctx.poisoned::<bf16>(n - first);
        cuda::silu_mul(
            &ctx.device,
            g16.as_slice::<bf16>().slice(first..n),
            u16.as_slice::<bf16>().slice(first..n),
            &mut out.as_mut_slice::<bf16>(),
        )
        .unwrap();
        let err = rel_err(&widen(&ctx.download::<bf16>(&out)), &want16[first..]);
        assert!(err < 4e-3, "silu_mul bf16 from {first}: error {err:e}");
    }
    let mut g = ctx.upload(&gate);
    cuda::silu_mul_in_place(&ctx.device, &mut g.as_mut_slice(), ubuf.as_slice()).unwrap();
    assert_eq!(ctx.download::<f32>(&g), ctx.download::<f32>(&out));

    let mut x = ctx.upload(&gate);
    cuda::add(&ctx.device, &mut x.as_mut_slice(), ubuf.as_slice()).unwrap();
    let sum: Vec<f32> = gate.iter().zip(&up).map(|(a, b)| a + b).collect();
    assert_eq!(ctx.download::<f32>(&x), sum);

    // Conversions round to nearest even exactly as `half` does, NaN and infinities included.
    let mut values = rng.vec(10_001);
    values.extend([
        f32::NAN,
        f32::INFINITY,
        -0.0,
        1e-40,
        65504.0,
        70000.0,
        3.0e38,
    ]);
    let vbuf = ctx.upload(&values);
    let mut b = ctx.poisoned::<bf16>(values.len());
    cuda::convert(
        &ctx.device,
        vbuf.as_slice::<f32>(),
        &mut b.as_mut_slice::<bf16>(),
    )
    .unwrap();
    let got_b = ctx.download::<bf16>(&b);
    let want_b: Vec<u16> = values
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect();
    assert_eq!(
        got_b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want_b
    );
    let mut h = ctx.poisoned::<f16>(values.len());
    cuda::convert(
        &ctx.device,
        vbuf.as_slice::<f32>(),
        &mut h.as_mut_slice::<f16>(),
    )
    .unwrap();
    let got_h: Vec<u16> = ctx
        .download::<f16>(&h)
        .iter()
        .map(|v| v.to_bits())
        .collect();
    for ((g, v), x) in got_h
        .iter()
        .zip(values.iter().map(|&v| f16::from_f32(v).to_bits()))
        .zip(&values)
    {
        // NaN payloads may differ; any NaN is right for a NaN.
        assert!(
            *g == v || (x.is_nan() && f16::from_bits(*g).is_nan()),
            "f16 of {x}: {g:#x} vs {v:#x}"
        );
    }
    let mut back = ctx.poisoned::<f32>(values.len());
    cuda::convert(
        &ctx.device,
        b.as_slice::<bf16>(),
        &mut back.as_mut_slice::<f32>(),
    )
    .unwrap();
    let back = ctx.download::<f32>(&back);
    for (g, w) in back.iter().zip(&got_b) {
        assert!(g.to_bits() == w.to_f32().to_bits() || g.is_nan());
    }
    assert!(
        cuda::convert(
            &ctx.device,
            b.as_slice::<bf16>(),
            &mut h.as_mut_slice::<f16>()
        )
        .is_err(),
        "bf16 to f16 is not built and says so"
    );
}

#[test]
fn embedding_gathers_rows_and_marks_bad_ids() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(6);
    let (vocab, hidden) = (100, 70);
    let table_f = rng.vec(vocab * hidden);
    let tokens: Vec<u32> = vec![0, 99, 42, 42, 100, 7];
    let tbuf = ctx.upload(&tokens);
    fn check<T: Elem>(
        ctx: &Ctx,
        table_f: &[f32],
        tokens: &[u32],
        tbuf: &DeviceBuffer,
        hidden: usize,
    ) {
        let table: Vec<T> = round(table_f);
        let table_buf = ctx.upload(&table);
        let mut out = ctx.poisoned::<f32>(tokens.len() * hidden);
        cuda::embedding(
            &ctx.device,
            table_buf.as_slice::<T>(),
            hidden,
            tbuf.as_slice(),
            &mut out.as_mut_slice(),
        )
        .unwrap();
        let got = ctx.download::<f32>(&out);
        for (i, &t) in tokens.iter().enumerate() {
            let row = &got[i * hidden..(i + 1) * hidden];
            if t as usize * hidden >= table.len() {
                assert!(row.iter().all(|v| v.is_nan()), "bad id {t} gives NaN");
            } else {
                assert_eq!(
                    row,
                    widen(&table[t as usize * hidden..(t as usize + 1) * hidden])
                );
            }
        }
    }
    check::<f32>(&ctx, &table_f, &tokens, &tbuf, hidden);
    check::<bf16>(&ctx, &table_f, &tokens, &tbuf, hidden);
    check::<f16>(&ctx, &table_f, &tokens, &tbuf, hidden);
}

/// A rank's part of the table (rows 40..70): its rows for the tokens it holds, zeros for the
/// rest (another rank's, or past the vocabulary), never NaN.
#[test]
fn embedding_part_gives_its_rows_and_zeros_elsewhere() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(12);
    let (hidden, first, rows) = (96, 40, 30);
    let table: Vec<bf16> = round(&rng.vec(rows * hidden));
    let table_buf = ctx.upload(&table);
    let tokens: Vec<u32> = vec![0, 39, 40, 55, 69, 70, 99, 100_000];
    let tbuf = ctx.upload(&tokens);
    let mut out = ctx.poisoned::<f32>(tokens.len() * hidden);
    cuda::embedding_part(
        &ctx.device,
        table_buf.as_slice::<bf16>(),
        hidden,
        tbuf.as_slice(),
        first,
        &mut out.as_mut_slice(),
    )
    .unwrap();
    let got = ctx.download::<f32>(&out);
    for (i, &t) in tokens.iter().enumerate() {
        let row = &got[i * hidden..(i + 1) * hidden];
        match (t as usize).checked_sub(first).filter(|&r| r < rows) {
            Some(r) => assert_eq!(
                row,
                widen(&table[r * hidden..(r + 1) * hidden]),
                "token {t}"
            ),
            None => assert!(row.iter().all(|&v| v == 0.0), "token {t} is another rank's"),
        }
    }
}

#[test]
fn argmax_takes_the_lowest_index_on_ties_and_never_nan() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(7);
    let vocab = 151_936;
    let rows = 5;
    let mut logits = rng.vec(rows * vocab);
    // Row 1: a tie between a late and an early index, and a NaN above both.
    logits[vocab + 150_000] = 5.0;
    logits[vocab + 1234] = 5.0;
    logits[vocab + 17] = f32::NAN;
    // Row 2: all NaN. Row 3: the maximum at the very end. Row 4: NaN, then only -inf.
    logits[2 * vocab..3 * vocab].fill(f32::NAN);
    logits[4 * vocab - 1] = 9.0;
    logits[4 * vocab..].fill(f32::NEG_INFINITY);
    logits[4 * vocab] = f32::NAN;
    let lbuf = ctx.upload(&logits);
    let mut out = ctx.poisoned::<u32>(rows);
    let mut scratch = ctx.upload(&vec![0u32; cuda::argmax_scratch_len(rows)]);
    // The host's rule, row by row, is what greedy sampling means everywhere.
    let want: Vec<u32> = logits.chunks(vocab).map(cpu::argmax).collect();
    assert_eq!(want[1..], [1234, 0, vocab as u32 - 1, 1]);
    // Twice: the first launch leaves the tickets as it found them.
    for _ in 0..2 {
        cuda::argmax(
            &ctx.device,
            lbuf.as_slice(),
            vocab,
            &mut out.as_mut_slice(),
            None,
            &mut scratch.as_mut_slice(),
        )
        .unwrap();
        assert_eq!(ctx.download::<u32>(&out), want);
    }
    let row_words = cuda::argmax_scratch_len(1);
    let tickets_left = ctx.download::<u32>(&scratch);
    assert!(
        tickets_left
            .chunks(row_words)
            .all(|row| row[row_words - 1] == 0)
    );

    // Rows of one chunk and of a few: ties between chunks and within one, -inf only.
    for n in [1, 5, 2048, 2049, 6000] {
        let mut small = rng.vec(3 * n);
        small[n - 1] = 7.0;
        small[n..2 * n].fill(f32::NEG_INFINITY);
        small[2 * n..].fill(1.0);
        let buf = ctx.upload(&small);
        let mut picks = ctx.poisoned::<u32>(3);
        let want: Vec<u32> = small.chunks(n).map(cpu::argmax).collect();
        let (logits, picks_out) = (buf.as_slice(), &mut picks.as_mut_slice());
        cuda::argmax(
            &ctx.device,
            logits,
            n,
            picks_out,
            None,
            &mut scratch.as_mut_slice(),
        )
        .unwrap();
        assert_eq!(ctx.download::<u32>(&picks), want, "rows of {n}");
    }

    // Fed to the next step: a pass of 3 tokens at 40.. becomes a one-token pass at 43 of
    // row 3's pick, read back through an event as the engine reads picks it ran ahead of.
    let row3 = lbuf.as_slice::<f32>().slice(3 * vocab..4 * vocab);
    let mut pick = ctx.poisoned::<u32>(1);
    let mut feed = ctx.upload(&[40i32, 43, 7, 8, 9]);
    cuda::argmax(
        &ctx.device,
        row3,
        vocab,
        &mut pick.as_mut_slice(),
        Some(&mut feed.as_mut_slice()),
        &mut scratch.as_mut_slice(),
    )
    .unwrap();
    let mut host = [0u32];
    let event = ctx.device.new_event().unwrap();
    // SAFETY: `host` is read only after the event, and outlives it.
    unsafe { ctx.device.download_async(pick.as_slice(), &mut host) }.unwrap();
    ctx.device.mark(&event).unwrap();
    event.wait().unwrap();
    assert_eq!(host, [want[3]]);
    assert_eq!(ctx.download::<i32>(&feed), [43, 44, want[3] as i32, 8, 9]);
    // One row only: the next step takes one token.
    let err = cuda::argmax(
        &ctx.device,
        lbuf.as_slice(),
        vocab,
        &mut out.as_mut_slice(),
        Some(&mut feed.as_mut_slice()),
        &mut scratch.as_mut_slice(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("one row"), "{err}");
    // Scratch for fewer rows than asked for is refused, not overrun.
    let err = cuda::argmax(
        &ctx.device,
        lbuf.as_slice(),
        vocab,
        &mut out.as_mut_slice(),
        None,
        &mut scratch
            .as_mut_slice()
            .slice_mut(0..cuda::argmax_scratch_len(1)),
    )
    .unwrap_err();
    assert!(err.to_string().contains("scratch"), "{err}");
}

/// A product's rows cut into its matrices' outputs by columns, exactly.
#[test]
fn split_columns_gives_each_output_its_columns() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(31);
    let widths = [24, 8, 8];
    let width: usize = widths.iter().sum();
    for rows in [1, 7, 300] {
        let src = rng.vec(rows * width);
        let sbuf = ctx.upload(&src);
        let mut bufs: Vec<_> = widths
            .iter()
            .map(|w| ctx.poisoned::<f32>(rows * w))
            .collect();
        let mut outs: Vec<_> = bufs.iter_mut().map(|b| b.as_mut_slice::<f32>()).collect();
        cuda::split_columns(&ctx.device, sbuf.as_slice(), &mut outs, &widths).unwrap();
        drop(outs);
        for (i, buf) in bufs.iter().enumerate() {
            let first: usize = widths[..i].iter().sum();
            let want: Vec<f32> = (0..rows)
                .flat_map(|r| src[r * width + first..r * width + first + widths[i]].to_vec())
                .collect();
            assert_eq!(
                bits(&ctx.download::<f32>(buf)),
                bits(&want),
                "{rows} rows, output {i}"
            );
        }
    }
    // A width that is not a multiple of 4 is refused.
    let sbuf = ctx.upload(&rng.vec(6));
    let mut y = ctx.poisoned::<f32>(6);
    let e = cuda::split_columns(&ctx.device, sbuf.as_slice(), &mut [y.as_mut_slice()], &[6])
        .unwrap_err();
    assert!(e.to_string().contains("multiple of 4"), "{e}");
}
