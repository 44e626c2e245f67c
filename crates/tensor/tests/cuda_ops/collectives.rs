//! What a tensor-parallel group's GPUs use to meet: NCCL's all-gather, and the pitched copy
//! that places a rank's part of the logits in whole rows.

use super::*;

/// A group of one GPU (the most one GPU can hold: NCCL gives each rank a GPU of its own)
/// checks the library's loading and the call's arguments; the gathered values are the rank's.
#[test]
fn nccl_gathers_a_group_of_one() {
    let Some(ctx) = Ctx::new() else { return };
    let group = match cuda::NcclGroup::new(std::slice::from_ref(&ctx.device)) {
        Ok(group) => group,
        Err(e @ CudaError::Unavailable { .. }) => {
            eprintln!("skipped: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    eprintln!("NCCL {}", cuda::nccl_version().unwrap());
    let send: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let sbuf = ctx.upload(&send);
    let mut recv = ctx.poisoned::<f32>(1000);
    group
        .all_gather(0, &ctx.device, sbuf.as_slice(), &mut recv.as_mut_slice())
        .unwrap();
    assert_eq!(ctx.download::<f32>(&recv), send);
    // Rank order over one rank: the values come back as they were.
    let mut values = ctx.upload(&send);
    let mut room = ctx.poisoned::<f32>(1000);
    group
        .all_reduce_in_rank_order(
            0,
            &ctx.device,
            &mut values.as_mut_slice(),
            &mut room.as_mut_slice(),
        )
        .unwrap();
    assert_eq!(ctx.download::<f32>(&values), send);
    let mut wrong = ctx.poisoned::<f32>(999);
    let refused = group.all_gather(0, &ctx.device, sbuf.as_slice(), &mut wrong.as_mut_slice());
    assert!(
        refused.is_err(),
        "a receive buffer of the wrong length is refused"
    );
    group.abort();
    let stopped = group.all_gather(0, &ctx.device, sbuf.as_slice(), &mut recv.as_mut_slice());
    assert!(stopped.unwrap_err().to_string().contains("stopped"));
}

/// Three rows of a part 5 wide land in rows 12 wide at column 4; the rest stays.
#[test]
fn copy_rows_moves_a_block_of_columns() {
    let Some(ctx) = Ctx::new() else { return };
    let (rows, width, src_pitch, dst_pitch, at) = (3, 5, 5, 12, 4);
    let src: Vec<f32> = (0..rows * src_pitch).map(|i| i as f32).collect();
    let sbuf = ctx.upload(&src);
    let mut dst = ctx.upload(&vec![-1f32; rows * dst_pitch]);
    let mut whole = dst.as_mut_slice::<f32>();
    let mut tail = whole.slice_mut(at..rows * dst_pitch);
    ctx.device
        .copy_rows(
            sbuf.as_slice(),
            src_pitch,
            &mut tail,
            dst_pitch,
            [rows, width],
        )
        .unwrap();
    let got = ctx.download::<f32>(&dst);
    for r in 0..rows {
        for c in 0..dst_pitch {
            let want = match c.checked_sub(at).filter(|&k| k < width) {
                Some(k) => src[r * src_pitch + k],
                None => -1.0,
            };
            assert_eq!(got[r * dst_pitch + c], want, "row {r} column {c}");
        }
    }
    let mut short = ctx.poisoned::<f32>(10);
    let refused = ctx.device.copy_rows(
        sbuf.as_slice::<f32>(),
        src_pitch,
        &mut short.as_mut_slice(),
        dst_pitch,
        [rows, width],
    );
    assert!(refused.is_err(), "a destination too short is refused");
}

/// Three ranks' partial sums of an odd length, added in rank order: the host's bits.
#[test]
fn sum_parts_adds_in_rank_order() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(21);
    let (ranks, n) = (3, 10_007);
    let parts = rng.vec(ranks * n);
    let pbuf = ctx.upload(&parts);
    let mut out = ctx.poisoned::<f32>(n);
    cuda::sum_parts(&ctx.device, pbuf.as_slice(), &mut out.as_mut_slice()).unwrap();
    let want: Vec<u32> = (0..n)
        .map(|i| ((parts[i] + parts[n + i]) + parts[2 * n + i]).to_bits())
        .collect();
    let got: Vec<u32> = ctx
        .download::<f32>(&out)
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert!(got == want, "the rank-order sums, bit for bit");
}
