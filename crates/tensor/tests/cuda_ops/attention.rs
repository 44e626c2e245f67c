//! Attention: prompt and decode kernels over paged caches, the decode step's fused rotation
//! and store, and decode rows of many sequences in one launch.

use super::*;

/// Causal attention in f64 over the cache as stored: query `i` (at position `pos0 + i`)
/// sees positions `..=pos0 + i`.
fn attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos0: usize,
    n: usize,
    shape: AttentionShape,
    scale: f32,
) -> Vec<f64> {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim: d,
    } = shape;
    let group = n_heads / n_kv_heads;
    let kv_row = n_kv_heads * d;
    let mut out = vec![0f64; n * n_heads * d];
    for i in 0..n {
        for h in 0..n_heads {
            let off = (h / group) * d;
            let qh = &q[(i * n_heads + h) * d..][..d];
            let scores: Vec<f64> = (0..=pos0 + i)
                .map(|t| {
                    (0..d)
                        .map(|e| qh[e] as f64 * k[t * kv_row + off + e] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::MIN, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = weights.iter().sum();
            // Key-outer: a long cache (thousands of keys) stays quick to check.
            let o = &mut out[(i * n_heads + h) * d..][..d];
            for (t, w) in weights.iter().enumerate() {
                let vt = &v[t * kv_row + off..][..d];
                for (o, &x) in o.iter_mut().zip(vt) {
                    *o += w / z * x as f64;
                }
            }
        }
    }
    out
}

/// Positions a test pool's block holds.
const BLOCK: usize = 16;

/// A sequence's keys and values as a KV pool holds them: blocks of [`BLOCK`] positions laid out
/// `[keys, values][BLOCK][kv_row]` (one layer), the sequence's blocks in reverse pool order
/// behind a foreign block 0, and NaN wherever the sequence has no row.
pub(super) struct Paged {
    pool: DeviceBuffer,
    table: DeviceBuffer,
    kv_row: usize,
    blocks: usize,
}

/// Writes `k` and `v` (`[positions, kv_row]`) at positions `0..` of the sequence whose blocks
/// `table` lists, in a pool of blocks laid out `[keys (BLOCK rows), values (BLOCK rows)]`.
fn write_rows<T: Elem>(pool: &mut [T], table: &[i32], kv_row: usize, k: &[T], v: &[T]) {
    let per_block = 2 * BLOCK * kv_row;
    for t in 0..k.len() / kv_row {
        let at = table[t / BLOCK] as usize * per_block + (t % BLOCK) * kv_row;
        pool[at..at + kv_row].copy_from_slice(&k[t * kv_row..(t + 1) * kv_row]);
        let at = at + BLOCK * kv_row;
        pool[at..at + kv_row].copy_from_slice(&v[t * kv_row..(t + 1) * kv_row]);
    }
}

impl Paged {
    /// `k` and `v` (`[rows, kv_row]`) at positions `0..rows`, in a table covering `capacity`.
    pub(super) fn new<T: Elem>(
        ctx: &Ctx,
        k: &[T],
        v: &[T],
        kv_row: usize,
        capacity: usize,
    ) -> Paged {
        let blocks = capacity.div_ceil(BLOCK);
        let stride = 2 * BLOCK * kv_row;
        let mut pool = vec![T::from_f32(f32::NAN); (blocks + 1) * stride];
        let table: Vec<i32> = (0..blocks).map(|i| (blocks - i) as i32).collect();
        write_rows(&mut pool, &table, kv_row, k, v);
        Paged {
            pool: ctx.upload(&pool),
            table: ctx.upload(&table),
            kv_row,
            blocks,
        }
    }

    pub(super) fn cache<T: Elem>(&self) -> PagedCache<'_, T> {
        PagedCache {
            pool: self.pool.as_slice(),
            keys_offset: 0,
            values_offset: BLOCK * self.kv_row,
            table: self.table.as_slice(),
            block_size: BLOCK,
            block_stride: 2 * BLOCK * self.kv_row,
        }
    }

    fn cache_mut<T: Elem>(&mut self) -> PagedCacheMut<'_, T> {
        PagedCacheMut {
            pool: self.pool.as_mut_slice(),
            keys_offset: 0,
            values_offset: BLOCK * self.kv_row,
            table: self.table.as_slice(),
            block_size: BLOCK,
            block_stride: 2 * BLOCK * self.kv_row,
        }
    }

    /// The sequence's keys and values back in position order, every position the table covers.
    fn rows<T: Elem + Default>(&self, ctx: &Ctx) -> (Vec<T>, Vec<T>) {
        let pool = ctx.download::<T>(&self.pool);
        let (kv_row, stride) = (self.kv_row, 2 * BLOCK * self.kv_row);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for t in 0..self.blocks * BLOCK {
            let at = (self.blocks - t / BLOCK) * stride + (t % BLOCK) * kv_row;
            k.extend_from_slice(&pool[at..at + kv_row]);
            v.extend_from_slice(&pool[at + BLOCK * kv_row..at + BLOCK * kv_row + kv_row]);
        }
        (k, v)
    }
}

fn check_attention<T: Elem>(
    ctx: &Ctx,
    rng: &mut Rng,
    shape: AttentionShape,
    pos0: usize,
    n: usize,
) {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let positions = pos0 + n;
    let kv_len = positions * n_kv_heads * head_dim;
    // Keys scaled up so some scores are large and the softmax is far from uniform.
    let k: Vec<T> = round(&rng.vec(kv_len).iter().map(|x| x * 3.0).collect::<Vec<_>>());
    let v: Vec<T> = round(&rng.vec(kv_len));
    let q = rng.vec(n * n_heads * head_dim);
    let (kf, vf) = (widen(&k), widen(&v));
    let scale = 1.0 / (head_dim as f32).sqrt();
    let kv_row = n_kv_heads * head_dim;
    let (cache, qbuf) = (Paged::new(ctx, &k, &v, kv_row, positions), ctx.upload(&q));
    let what = format!("{} cache, {shape:?}, pos0 {pos0}, n {n}", T::FLOAT);

    let want = attention_reference(&q, &kf, &vf, pos0, n, shape, scale);
    // f32 throughout, then on the tensor cores (heads of 64 and 128) with bf16 operands and
    // so a bf16-sized error.
    let mut split_scratch = ctx.poisoned::<f32>(cuda::attention_prefill_scratch_len(shape));
    for precision in [AttentionPrecision::F32, AttentionPrecision::Bf16] {
        let mut out = ctx.poisoned::<f32>(n * n_heads * head_dim);
        cuda::attention_prefill(
            &ctx.device,
            qbuf.as_slice(),
            cache.cache::<T>(),
            pos0,
            n,
            shape,
            scale,
            precision,
            &mut split_scratch.as_mut_slice(),
            &mut out.as_mut_slice(),
        )
        .unwrap();
        let got = ctx.download::<f32>(&out);
        let (err, bound) = match precision {
            AttentionPrecision::F32 => (max_abs_err(&got, &want), 1e-4),
            AttentionPrecision::Bf16 => (rel_err(&got, &want), 2e-2),
        };
        assert!(
            err < bound,
            "attention_prefill {precision:?}, {what}: error {err:e}"
        );
    }

    // Decode: the last query alone over every position, in f32 and (a 16-bit cache, heads of
    // 64 or 128) on the tensor cores with 16-bit queries and probabilities.
    let q_last = &q[(n - 1) * n_heads * head_dim..];
    let want = attention_reference(q_last, &kf, &vf, positions - 1, 1, shape, scale);
    let qbuf = ctx.upload(q_last);
    // The context read on the device, over a table with poisoned positions past it (as a
    // graph's table is, sized for the whole context): the same bits as the host's context.
    let padded = Paged::new(ctx, &k, &v, kv_row, positions + 40);
    let context_buf = ctx.upload(&[positions as i32]);
    // One scratch for all: each launch must leave its tickets zero for the next.
    let mut scratch = ctx.poisoned::<f32>(cuda::attention_decode_scratch_len(shape));
    cuda::attention_decode_scratch_reset(&ctx.device, shape, &mut scratch.as_mut_slice()).unwrap();
    for precision in [AttentionPrecision::F32, AttentionPrecision::Bf16] {
        let mut results = Vec::new();
        for (context, paged) in [
            (Position::Host(positions), &cache),
            (Position::Device(context_buf.as_slice()), &padded),
        ] {
            let mut out = ctx.poisoned::<f32>(n_heads * head_dim);
            cuda::attention_decode(
                &ctx.device,
                qbuf.as_slice(),
                paged.cache::<T>(),
                context,
                shape,
                scale,
                precision,
                &mut scratch.as_mut_slice(),
                &mut out.as_mut_slice(),
            )
            .unwrap();
            results.push(ctx.download::<f32>(&out));
        }
        let (err, bound) = match precision {
            AttentionPrecision::F32 => (max_abs_err(&results[0], &want), 1e-4),
            AttentionPrecision::Bf16 => (rel_err(&results[0], &want), 2e-2),
        };
        assert!(
            err < bound,
            "attention_decode {precision:?}, {what}: error {err:e}"
        );
        assert!(
            bits(&results[0]) == bits(&results[1]),
            "attention_decode {precision:?}, {what}: a context read on the device changed the result"
        );
    }
}

/// The decode step's fused path (queries and the new key normalised and rotated, the key and
/// value stored, inside the attention kernel) gives what rope_qk, kv_store and
/// attention_decode give one after the other: the same stored row and the same output, bit for
/// bit, for either layout, with and without the norms, from the
/// first position to many chunks; a context read on the device gives the same bits.
#[test]
fn attention_decode_rope_matches_rope_then_store_then_attention() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(11);
    fn check<T: Elem + Default>(
        ctx: &Ctx,
        rng: &mut Rng,
        shape: AttentionShape,
        pos: usize,
        layout: RopeLayout,
        with_norm: bool,
        precision: AttentionPrecision,
    ) {
        let AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        } = shape;
        let (kv_dim, capacity) = (n_kv_heads * head_dim, pos + 9);
        let (cos, sin) = rope_tables(capacity + 4, head_dim, 1e4);
        let (cbuf, sbuf) = (ctx.upload(&cos), ctx.upload(&sin));
        let norm_w: Vec<f32> = rng.vec(head_dim).iter().map(|x| 1.0 + 0.5 * x).collect();
        let nbuf = ctx.upload(&norm_w);
        let norm = with_norm.then(|| RopeNorm {
            weight: nbuf.as_slice(),
            eps: 1e-6,
        });
        let q = rng.vec(n_heads * head_dim);
        let k: Vec<f32> = rng.vec(kv_dim).iter().map(|x| x * 3.0).collect();
        let v = rng.vec(kv_dim);
        // Earlier positions filled, the step's own and later ones poisoned.
        let mut cache: Vec<f32> = rng.vec(pos * kv_dim).iter().map(|x| x * 3.0).collect();
        cache.resize(capacity * kv_dim, f32::NAN);
        let mut values = rng.vec(pos * kv_dim);
        values.resize(capacity * kv_dim, f32::NAN);
        let (cache, values) = (round::<T>(&cache), round::<T>(&values));
        let scale = 1.0 / (head_dim as f32).sqrt();
        let what = format!(
            "{} cache, {shape:?}, pos {pos}, {layout:?}, norm {with_norm}, {precision:?}",
            T::FLOAT
        );

        // One after the other.
        let (mut qb, mut kb, vb) = (ctx.upload(&q), ctx.upload(&k), ctx.upload(&v));
        let mut paged = Paged::new(ctx, &cache, &values, kv_dim, capacity);
        cuda::rope_qk(
            &ctx.device,
            RopeHeads {
                x: qb.as_mut_slice(),
                n_heads,
                norm,
            },
            Some(RopeHeads {
                x: kb.as_mut_slice(),
                n_heads: n_kv_heads,
                norm,
            }),
            head_dim,
            Position::Host(pos),
            cbuf.as_slice(),
            sbuf.as_slice(),
            layout,
        )
        .unwrap();
        cuda::kv_store(
            &ctx.device,
            kb.as_slice(),
            vb.as_slice(),
            &mut paged.cache_mut::<T>(),
            kv_dim,
            Position::Host(pos),
        )
        .unwrap();
        let mut scratch = ctx.poisoned::<f32>(cuda::attention_decode_scratch_len(shape));
        cuda::attention_decode_scratch_reset(&ctx.device, shape, &mut scratch.as_mut_slice())
            .unwrap();
        let mut want = ctx.poisoned::<f32>(n_heads * head_dim);
        cuda::attention_decode(
            &ctx.device,
            qb.as_slice(),
            paged.cache::<T>(),
            Position::Host(pos + 1),
            shape,
            scale,
            precision,
            &mut scratch.as_mut_slice(),
            &mut want.as_mut_slice(),
        )
        .unwrap();
        let want = ctx.download::<f32>(&want);
        let (want_k, want_v) = paged.rows::<T>(ctx);

        // Fused, the context known on the host and read on the device.
        let (qb, kb) = (ctx.upload(&q), ctx.upload(&k));
        let context_buf = ctx.upload(&[pos as i32 + 1]);
        let mut outs = Vec::new();
        for context in [
            Position::Host(pos + 1),
            Position::Device(context_buf.as_slice()),
        ] {
            let mut paged = Paged::new(ctx, &cache, &values, kv_dim, capacity);
            let mut out = ctx.poisoned::<f32>(n_heads * head_dim);
            let rope = cuda::DecodeRope {
                k_new: kb.as_slice(),
                v_new: vb.as_slice(),
                q_norm: norm,
                k_norm: norm,
                cos: cbuf.as_slice(),
                sin: sbuf.as_slice(),
                layout,
            };
            cuda::attention_decode_rope(
                &ctx.device,
                qb.as_slice(),
                rope,
                &mut paged.cache_mut::<T>(),
                context,
                shape,
                scale,
                precision,
                &mut scratch.as_mut_slice(),
                &mut out.as_mut_slice(),
            )
            .unwrap();
            let (got_k, got_v) = paged.rows::<T>(ctx);
            let (got_k, got_v) = (widen(&got_k), widen(&got_v));
            // Earlier positions untouched, later ones never written (still NaN).
            let row = pos * kv_dim..(pos + 1) * kv_dim;
            assert!(
                bits(&got_v) == bits(&widen(&want_v)),
                "{what}: stored values"
            );
            assert!(
                bits(&got_k[..row.start]) == bits(&widen(&want_k[..row.start])),
                "{what}"
            );
            assert!(
                got_k[row.end..].iter().all(|x| x.is_nan()),
                "{what}: wrote past the step"
            );
            assert!(
                bits(&got_k[row.clone()]) == bits(&widen(&want_k[row])),
                "{what}: stored key"
            );
            outs.push(ctx.download::<f32>(&out));
        }
        // The same bits: a prompt row (rotated by rope_qk, stored, attending as a decode row
        // under --batch-invariant) must get those of the same position decoded.
        assert!(bits(&outs[0]) == bits(&want), "{what}: output");
        assert!(
            bits(&outs[0]) == bits(&outs[1]),
            "{what}: a context read on the device changed the result"
        );
    }
    let shape = |n_heads, n_kv_heads, head_dim| AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    for (s, pos) in [
        (shape(32, 8, 128), 0),
        (shape(32, 8, 128), 37),
        (shape(16, 8, 128), 300),
        (shape(32, 4, 128), 4004),
        (shape(6, 2, 64), 70),
        (shape(20, 1, 80), 130),
    ] {
        for layout in [RopeLayout::Halves, RopeLayout::Pairs] {
            for with_norm in [false, true] {
                let f32 = AttentionPrecision::F32;
                check::<f32>(&ctx, &mut rng, s, pos, layout, with_norm, f32);
                // 16-bit caches on the tensor cores too (heads of 64 and 128).
                for precision in [f32, AttentionPrecision::Bf16] {
                    check::<bf16>(&ctx, &mut rng, s, pos, layout, with_norm, precision);
                }
                check::<f16>(
                    &ctx,
                    &mut rng,
                    s,
                    pos,
                    layout,
                    with_norm,
                    AttentionPrecision::Bf16,
                );
            }
        }
    }
    // Heads whose halves would split a lane's values take the two ops instead.
    // (100: four values a lane, halves of 50.)
    assert!(!cuda::attention_decode_rope_fits(100, RopeLayout::Halves));
    assert!(cuda::attention_decode_rope_fits(100, RopeLayout::Pairs));
    assert!(cuda::attention_decode_rope_fits(128, RopeLayout::Halves));
}

/// Keys and values land at their positions of the sequence's blocks, converted, in one
/// launch; the position read on the device writes the same; rows past the table are dropped,
/// never written out of it.
#[test]
fn kv_store_writes_rows_at_their_positions() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(9);
    fn check<T: Elem + Default>(ctx: &Ctx, rng: &mut Rng) {
        // Two blocks; the rows straddle them.
        let (kv_dim, capacity, rows, pos0) = (24, 2 * BLOCK, 3, BLOCK - 1);
        let (k, v) = (rng.vec(rows * kv_dim), rng.vec(rows * kv_dim));
        let (kb, vb) = (ctx.upload(&k), ctx.upload(&v));
        let pos_buf = ctx.upload(&[pos0 as i32]);
        let empty: [T; 0] = [];
        for pos in [Position::Host(pos0), Position::Device(pos_buf.as_slice())] {
            let mut paged = Paged::new(ctx, &empty, &empty, kv_dim, capacity);
            cuda::kv_store(
                &ctx.device,
                kb.as_slice(),
                vb.as_slice(),
                &mut paged.cache_mut::<T>(),
                kv_dim,
                pos,
            )
            .unwrap();
            let (kc, vc) = paged.rows::<T>(ctx);
            let at = pos0 * kv_dim..(pos0 + rows) * kv_dim;
            let what = T::FLOAT;
            assert_eq!(widen(&kc[at.clone()]), widen(&round::<T>(&k)), "{what}");
            assert_eq!(widen(&vc[at.clone()]), widen(&round::<T>(&v)), "{what}");
            assert!(widen(&kc[..at.start]).iter().all(|x| x.is_nan()));
            assert!(widen(&vc[at.end..]).iter().all(|x| x.is_nan()));
            // The foreign block is untouched.
            let pool = widen(&ctx.download::<T>(&paged.pool));
            assert!(pool[..2 * BLOCK * kv_dim].iter().all(|x| x.is_nan()));
        }
        // Past the table: the host refuses, the device drops the rows that do not fit.
        let mut paged = Paged::new(ctx, &empty, &empty, kv_dim, capacity);
        let late = capacity - 2;
        let err = cuda::kv_store(
            &ctx.device,
            kb.as_slice(),
            vb.as_slice(),
            &mut paged.cache_mut::<T>(),
            kv_dim,
            Position::Host(late),
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("33 positions in a table of 2 blocks of 16"),
            "{err}"
        );
        let late_buf = ctx.upload(&[late as i32]);
        cuda::kv_store(
            &ctx.device,
            kb.as_slice(),
            vb.as_slice(),
            &mut paged.cache_mut::<T>(),
            kv_dim,
            Position::Device(late_buf.as_slice()),
        )
        .unwrap();
        let (kc, _) = paged.rows::<T>(ctx);
        let kc = widen(&kc);
        assert_eq!(
            kc[late * kv_dim..],
            widen(&round::<T>(&k[..2 * kv_dim]))[..]
        );
        let pool = widen(&ctx.download::<T>(&paged.pool));
        assert!(pool[..2 * BLOCK * kv_dim].iter().all(|x| x.is_nan()));
    }
    check::<f32>(&ctx, &mut rng);
    check::<bf16>(&ctx, &mut rng);
    check::<f16>(&ctx, &mut rng);
}

#[test]
fn attention_matches_f64_reference() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(8);
    let shape = |n_heads, n_kv_heads, head_dim| AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    // Odd head widths (padded lanes), groups of 1 to 20 (more than one block of rows), short
    // and long contexts (one split, many splits).
    let cases = [
        (shape(6, 2, 20), 0, 7),
        (shape(6, 2, 20), 30, 1),
        (shape(8, 8, 64), 3, 33),
        (shape(32, 8, 128), 0, 50),
        (shape(32, 8, 128), 4000, 5),
        (shape(12, 2, 80), 100, 17),
        (shape(20, 1, 128), 64, 16),
        (shape(4, 2, 256), 700, 3),
        // Several tensor-core blocks of queries, with and without earlier positions.
        (shape(8, 2, 64), 0, 130),
        (shape(16, 8, 128), 37, 300),
        // Short chunks over long caches, whose keys split (a chat's next turn): both kernels.
        (shape(32, 8, 128), 8200, 78),
        (shape(8, 2, 64), 2000, 130),
        (shape(6, 2, 20), 1500, 3),
    ];
    for (s, pos0, n) in cases {
        check_attention::<f32>(&ctx, &mut rng, s, pos0, n);
        check_attention::<bf16>(&ctx, &mut rng, s, pos0, n);
    }
    check_attention::<f16>(&ctx, &mut rng, shape(32, 8, 128), 1000, 9);
    check_attention::<f16>(&ctx, &mut rng, shape(8, 2, 64), 70, 150);
    // Three tiles of keys before the queries, a chunk ending one key into a tile.
    check_attention::<bf16>(&ctx, &mut rng, shape(4, 4, 128), 192, 129);
}

/// Several sequences in one pool, each over its own blocks: a table of `stride` entries per
/// sequence, laid end to end, and the pool's blocks dealt out to them in reverse.
struct PagedSequences {
    pool: DeviceBuffer,
    tables: DeviceBuffer,
    kv_row: usize,
    stride: usize,
}

impl PagedSequences {
    /// Sequence `s` holds `keys[s]` and `values[s]` (`[positions, kv_row]`) at `0..`.
    fn new<T: Elem>(
        ctx: &Ctx,
        keys: &[Vec<T>],
        values: &[Vec<T>],
        kv_row: usize,
        stride: usize,
    ) -> Self {
        let per_block = 2 * BLOCK * kv_row;
        let total = keys.len() * stride;
        let mut pool = vec![T::from_f32(f32::NAN); (total + 1) * per_block];
        let tables: Vec<i32> = (0..total).map(|i| (total - i) as i32).collect();
        for (s, (k, v)) in keys.iter().zip(values).enumerate() {
            write_rows(&mut pool, &tables[s * stride..], kv_row, k, v);
        }
        PagedSequences {
            pool: ctx.upload(&pool),
            tables: ctx.upload(&tables),
            kv_row,
            stride,
        }
    }

    /// Sequence `seq`'s cache alone, or every sequence's (`None`: all the tables).
    fn cache_mut<T: Elem>(&mut self, seq: Option<usize>) -> PagedCacheMut<'_, T> {
        let tables = match seq {
            Some(s) => self
                .tables
                .as_slice()
                .slice(s * self.stride..(s + 1) * self.stride),
            None => self.tables.as_slice(),
        };
        PagedCacheMut {
            pool: self.pool.as_mut_slice(),
            keys_offset: 0,
            values_offset: BLOCK * self.kv_row,
            table: tables,
            block_size: BLOCK,
            block_stride: 2 * BLOCK * self.kv_row,
        }
    }
}

/// A decode launch over many sequences' rows (`DecodeRows`: each row its own context and
/// blocks, read on the device; blocks then take several chunks each) gives every row the
/// bits of its own launch, plain and fused (the new key rotated and stored by the kernel),
/// on the CUDA cores and the tensor cores, for contexts from one key to thousands.
#[test]
fn attention_decode_over_many_rows_gives_each_its_bits_alone() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(23);
    fn check<T: Elem + Default>(
        ctx: &Ctx,
        rng: &mut Rng,
        contexts: &[usize],
        precision: AttentionPrecision,
        fused: bool,
    ) {
        let shape = AttentionShape {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
        };
        let (q_dim, kv_dim) = (
            shape.n_heads * shape.head_dim,
            shape.n_kv_heads * shape.head_dim,
        );
        let seqs = contexts.len();
        let stride = contexts.iter().max().unwrap().div_ceil(BLOCK) + 1;
        let keys: Vec<Vec<T>> = contexts
            .iter()
            .map(|&c| {
                round::<T>(
                    &rng.vec(c * kv_dim)
                        .iter()
                        .map(|x| x * 3.0)
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        let values: Vec<Vec<T>> = contexts
            .iter()
            .map(|&c| round::<T>(&rng.vec(c * kv_dim)))
            .collect();
        // The pass's rows: sequence s's decode row at row 2s + 1 (the even rows another
        // sequence's prompt would hold), at position context - 1.
        let rows = 2 * seqs + 1;
        let q = rng.vec(rows * q_dim);
        let k_new: Vec<f32> = rng.vec(rows * kv_dim).iter().map(|x| x * 3.0).collect();
        let v_new = rng.vec(rows * kv_dim);
        let mut row_pos = vec![0i32; rows];
        let mut row_seq = vec![0i32; rows];
        let decode: Vec<i32> = (0..seqs).map(|s| 2 * s as i32 + 1).collect();
        for (s, &c) in contexts.iter().enumerate() {
            row_pos[2 * s + 1] = c as i32 - 1;
            row_seq[2 * s + 1] = s as i32;
        }
        let (qb, kb, vb) = (ctx.upload(&q), ctx.upload(&k_new), ctx.upload(&v_new));
        let (pos_b, seq_b, rows_b) = (
            ctx.upload(&row_pos),
            ctx.upload(&row_seq),
            ctx.upload(&decode),
        );
        let max_context = contexts.iter().max().unwrap() + 1;
        let (cos, sin) = rope_tables(max_context, shape.head_dim, 1e4);
        let (cbuf, sbuf) = (ctx.upload(&cos), ctx.upload(&sin));
        let rope = |k, v| decode_rope(k, v, cbuf.as_slice(), sbuf.as_slice());
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let what = format!(
            "{} cache, {contexts:?}, {precision:?}, fused {fused}",
            T::FLOAT
        );
        // A fused step's cache: the step's own position not written yet.
        let (keys, values): (Vec<Vec<T>>, Vec<Vec<T>>) = if fused {
            let cut = |x: &Vec<T>| x[..x.len() - kv_dim].to_vec();
            (
                keys.iter().map(cut).collect(),
                values.iter().map(cut).collect(),
            )
        } else {
            (keys, values)
        };

        let slab = cuda::attention_decode_scratch_len(shape);
        let mut scratch = ctx.poisoned::<f32>(slab * seqs);
        cuda::attention_decode_scratch_reset(&ctx.device, shape, &mut scratch.as_mut_slice())
            .unwrap();
        let mut together = PagedSequences::new(ctx, &keys, &values, kv_dim, stride);
        let mut out = ctx.poisoned::<f32>(rows * q_dim);
        let many = cuda::DecodeRows {
            rows: rows_b.as_slice(),
            row_pos: pos_b.as_slice(),
            row_seq: seq_b.as_slice(),
            table_stride: stride,
        };
        if fused {
            cuda::attention_decode_rope(
                &ctx.device,
                qb.as_slice(),
                rope(kb.as_slice(), vb.as_slice()),
                &mut together.cache_mut::<T>(None),
                many,
                shape,
                scale,
                precision,
                &mut scratch.as_mut_slice(),
                &mut out.as_mut_slice(),
            )
            .unwrap();
        } else {
            cuda::attention_decode(
                &ctx.device,
                qb.as_slice(),
                together.cache_mut::<T>(None).as_ref(),
                many,
                shape,
                scale,
                precision,
                &mut scratch.as_mut_slice(),
                &mut out.as_mut_slice(),
            )
            .unwrap();
        }
        let got = ctx.download::<f32>(&out);
        let got_pool = bits(&widen(&ctx.download::<T>(&together.pool)));

        let mut alone = PagedSequences::new(ctx, &keys, &values, kv_dim, stride);
        for (s, &c) in contexts.iter().enumerate() {
            let row = 2 * s + 1;
            let (qs, ks, vs) = (
                row * q_dim..(row + 1) * q_dim,
                row * kv_dim..(row + 1) * kv_dim,
                row * kv_dim..(row + 1) * kv_dim,
            );
            let mut one = ctx.poisoned::<f32>(q_dim);
            let q_row = qb.as_slice().slice(qs.clone());
            if fused {
                let r = rope(kb.as_slice().slice(ks), vb.as_slice().slice(vs));
                cuda::attention_decode_rope(
                    &ctx.device,
                    q_row,
                    r,
                    &mut alone.cache_mut::<T>(Some(s)),
                    Position::Host(c),
                    shape,
                    scale,
                    precision,
                    &mut scratch.as_mut_slice(),
                    &mut one.as_mut_slice(),
                )
                .unwrap();
            } else {
                cuda::attention_decode(
                    &ctx.device,
                    q_row,
                    alone.cache_mut::<T>(Some(s)).as_ref(),
                    Position::Host(c),
                    shape,
                    scale,
                    precision,
                    &mut scratch.as_mut_slice(),
                    &mut one.as_mut_slice(),
                )
                .unwrap();
            }
            let want = ctx.download::<f32>(&one);
            assert!(
                bits(&got[qs]) == bits(&want),
                "{what}: sequence {s} (context {c}) differs from its launch alone"
            );
        }
        // The rows between were left alone; the stored keys and values are the same.
        assert!(
            got[..q_dim].iter().all(|x| x.is_nan()),
            "{what}: wrote a row not asked for"
        );
        let alone_pool = bits(&widen(&ctx.download::<T>(&alone.pool)));
        assert!(
            got_pool == alone_pool,
            "{what}: the pools differ after the step"
        );
    }
    // Few rows (a block a chunk, as alone) and many (blocks taking several chunks each).
    let few = [1, 700];
    let many: Vec<usize> = (0..24)
        .map(|i| [1, 31, 33, 97, 600, 2100, 5000][i % 7] + i)
        .collect();
    for contexts in [&few[..], &many[..]] {
        for fused in [false, true] {
            check::<bf16>(&ctx, &mut rng, contexts, AttentionPrecision::Bf16, fused);
            check::<bf16>(&ctx, &mut rng, contexts, AttentionPrecision::F32, fused);
            check::<f32>(&ctx, &mut rng, contexts, AttentionPrecision::F32, fused);
        }
    }
}

/// The step's keys and values with the tables that rotate them (no norms).
fn decode_rope<'a>(
    k_new: cuda::DevSlice<'a, f32>,
    v_new: cuda::DevSlice<'a, f32>,
    cos: cuda::DevSlice<'a, f32>,
    sin: cuda::DevSlice<'a, f32>,
) -> cuda::DecodeRope<'a> {
    cuda::DecodeRope {
        k_new,
        v_new,
        q_norm: None,
        k_norm: None,
        cos,
        sin,
        layout: RopeLayout::Halves,
    }
}
