//! The batch-invariant prompt attention: every prompt row the bits the decode kernel gives
//! it alone, over head groups that fill a block's 8 columns with one to four rows, chunks
//! ending inside a tile, many chunks, and launches cut by the scratch.

use super::attention::Paged;
use super::*;

/// `attention_prompt_rows` of `n` rows at `pos0..` against `attention_decode` of each row
/// alone (tensor cores), bit for bit; `slabs`: rows of scratch at the last row's chunks (fewer
/// than `n` cuts the rows into several launches).
fn check<T: Elem>(
    ctx: &Ctx,
    rng: &mut Rng,
    shape: AttentionShape,
    pos0: usize,
    n: usize,
    slabs: usize,
) {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim: d,
    } = shape;
    let (q_dim, kv_dim) = (n_heads * d, n_kv_heads * d);
    let context = pos0 + n;
    let keys: Vec<T> = round(
        &rng.vec(context * kv_dim)
            .iter()
            .map(|x| x * 3.0)
            .collect::<Vec<_>>(),
    );
    let values: Vec<T> = round(&rng.vec(context * kv_dim));
    let paged = Paged::new(ctx, &keys, &values, kv_dim, context + 5);
    let q = ctx.upload(&rng.vec(n * q_dim));
    let scale = 1.0 / (d as f32).sqrt();
    let what = format!(
        "{} cache, {n_heads}/{n_kv_heads} heads of {d}, rows {pos0}..{context}",
        T::FLOAT
    );
    let most = cuda::attention_prompt_rows_max_context(
        &ctx.device,
        &paged.cache::<T>(),
        shape,
        AttentionPrecision::Bf16,
    );
    assert!(
        context <= most,
        "{what}: past the contexts the kernel takes ({most})"
    );

    let chunks = context.div_ceil(128);
    let slab = (chunks * n_heads * 2).next_multiple_of(4) + chunks * n_heads * d;
    let mut scratch = ctx.poisoned::<f32>(slab * slabs);
    let mut out = ctx.poisoned::<f32>(n * q_dim);
    cuda::attention_prompt_rows(
        &ctx.device,
        q.as_slice(),
        paged.cache::<T>(),
        pos0,
        n,
        shape,
        scale,
        &mut scratch.as_mut_slice(),
        &mut out.as_mut_slice(),
    )
    .unwrap();
    let got = ctx.download::<f32>(&out);

    let mut decode_scratch = ctx.poisoned::<f32>(cuda::attention_decode_scratch_len(shape));
    cuda::attention_decode_scratch_reset(&ctx.device, shape, &mut decode_scratch.as_mut_slice())
        .unwrap();
    let mut one = ctx.poisoned::<f32>(q_dim);
    for i in 0..n {
        let rows = i * q_dim..(i + 1) * q_dim;
        cuda::attention_decode(
            &ctx.device,
            q.as_slice().slice(rows.clone()),
            paged.cache::<T>(),
            Position::Host(pos0 + i + 1),
            shape,
            scale,
            AttentionPrecision::Bf16,
            &mut decode_scratch.as_mut_slice(),
            &mut one.as_mut_slice(),
        )
        .unwrap();
        let want = ctx.download::<f32>(&one);
        assert!(
            bits(&got[rows]) == bits(&want),
            "{what}: row {i} (position {}) differs from its decode alone",
            pos0 + i
        );
    }
}

#[test]
fn prompt_rows_get_the_bits_of_decode_rows() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(41);
    let shape = |n_heads, n_kv_heads, head_dim| AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    // Groups of 4 (two rows a set: qwen3-8b), 2 (four rows: qwen3-0.6b), 8 (one), 12 (a block
    // of 8 heads, then of 4: two rows), 3 (two rows, 6 columns); heads of 128 and 64.
    let shapes = [
        shape(32, 8, 128),
        shape(16, 8, 128),
        shape(16, 2, 64),
        shape(24, 2, 128),
        shape(6, 2, 64),
    ];
    // One chunk; a tile crossing a chunk's end; many chunks; a lone row; scratch for 5 rows.
    let cases = [
        (0, 40, 64),
        (100, 61, 64),
        (250, 300, 64),
        (1000, 1, 1),
        (380, 37, 5),
    ];
    for s in shapes {
        for &(pos0, n, slabs) in &cases {
            check::<bf16>(&ctx, &mut rng, s, pos0, n, slabs);
        }
    }
    check::<f16>(&ctx, &mut rng, shape(32, 8, 128), 70, 150, 64);
    check::<f16>(&ctx, &mut rng, shape(16, 2, 64), 130, 20, 64);
}

/// The longest context the kernel takes, and no longer: the rows there keep their bits, and
/// one row past it is refused (the model sends such rows through the decode kernel).
#[test]
fn prompt_rows_stop_where_decode_chunks_grow() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(43);
    let shape = AttentionShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
    };
    let kv_dim = shape.n_kv_heads * shape.head_dim;
    let probe = Paged::new::<bf16>(&ctx, &[], &[], kv_dim, 1);
    let most = cuda::attention_prompt_rows_max_context(
        &ctx.device,
        &probe.cache::<bf16>(),
        shape,
        AttentionPrecision::Bf16,
    );
    assert!(most >= 128, "the kernel takes no context ({most})");
    check::<bf16>(&ctx, &mut rng, shape, most - 20, 20, 64);

    let keys = round::<bf16>(&rng.vec((most + 1) * kv_dim));
    let paged = Paged::new(&ctx, &keys, &keys, kv_dim, most + 1);
    let q = ctx.upload(&rng.vec(2 * shape.n_heads * shape.head_dim));
    let mut scratch = ctx.poisoned::<f32>(1 << 22);
    let mut out = ctx.poisoned::<f32>(2 * shape.n_heads * shape.head_dim);
    let past = cuda::attention_prompt_rows(
        &ctx.device,
        q.as_slice(),
        paged.cache::<bf16>(),
        most - 1,
        2,
        shape,
        0.1,
        &mut scratch.as_mut_slice(),
        &mut out.as_mut_slice(),
    );
    assert!(past.is_err(), "a row past {most} was taken");
    // An f32 cache has no tensor-core decode: the kernel takes nothing.
    let f32_cache = Paged::new::<f32>(&ctx, &[], &[], kv_dim, 1);
    let none = cuda::attention_prompt_rows_max_context(
        &ctx.device,
        &f32_cache.cache::<f32>(),
        shape,
        AttentionPrecision::Bf16,
    );
    assert_eq!(none, 0);
}
