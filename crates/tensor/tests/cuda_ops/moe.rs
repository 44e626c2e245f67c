//! Mixture-of-experts layers: routing, the experts' products and the combine.

use super::*;

/// One token's routing in f64: softmax over its router logits, the top-k (ties to the lower
/// index), and their weights, renormalised with `normalize`.
fn reference_routes(row: &[f32], routing: cuda::Routing) -> Vec<(usize, f64)> {
    let max = row.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
    let exp: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
    let chosen = &order[..routing.top_k];
    let total: f64 = chosen.iter().map(|&e| exp[e] / sum).sum();
    let weight = |e: usize| {
        let p = exp[e] / sum;
        if routing.normalize { p / total } else { p }
    };
    chosen.iter().map(|&e| (e, weight(e))).collect()
}

/// Where [`cuda::moe_route`] writes, poisoned until it does.
struct RouteBuffers {
    ids: DeviceBuffer,
    weights: DeviceBuffer,
    order: DeviceBuffer,
    tiles: DeviceBuffer,
}

impl RouteBuffers {
    fn new(ctx: &Ctx, routing: &cuda::Routing, tokens: usize, road: ExpertRoad) -> Self {
        let pairs = tokens * routing.top_k;
        RouteBuffers {
            ids: ctx.poisoned::<i32>(pairs),
            weights: ctx.poisoned::<f32>(pairs),
            order: ctx.poisoned::<i32>(pairs),
            tiles: ctx.poisoned::<i32>(routing.tiles_len(tokens, road)),
        }
    }

    fn routes(&mut self, road: ExpertRoad) -> cuda::Routes<'_> {
        cuda::Routes {
            ids: self.ids.as_mut_slice(),
            weights: self.weights.as_mut_slice(),
            order: self.order.as_mut_slice(),
            tiles: self.tiles.as_mut_slice(),
            road,
        }
    }
}

/// The epsilon of the RMS norm inside the MoE tests' gate/up products.
const MOE_NORM_EPS: f32 = 1e-6;

/// A mixture-of-experts layer in f64: softmax over the router logits, the top-k (ties to the
/// lower index), weights renormalised with `normalize`, and the weighted sum of each chosen
/// expert's SwiGLU MLP added to `x` (standing for the residual), the experts reading
/// `rms_norm(x) · norm` where a norm weight is given, else `x`. Returns the experts chosen per
/// token and the residual after the layer.
#[allow(clippy::too_many_arguments)]
fn moe_reference(
    logits: &[f32],
    x: &[f32],
    gate_up: &[f32],
    down: &[f32],
    routing: cuda::Routing,
    hidden: usize,
    width: usize,
    norm: Option<&[f32]>,
) -> (Vec<i32>, Vec<f64>) {
    let experts = routing.experts;
    let tokens = logits.len() / experts;
    // The output is added to the residual, which is `x` here.
    let (mut ids, mut out) = (Vec::new(), x.iter().map(|&v| v as f64).collect::<Vec<_>>());
    for t in 0..tokens {
        let xt = &x[t * hidden..(t + 1) * hidden];
        for (e, weight) in reference_routes(&logits[t * experts..(t + 1) * experts], routing) {
            ids.push(e as i32);
            let dot = |w: &[f32], v: &[f64]| -> f64 {
                w.iter().zip(v).map(|(&a, &b)| a as f64 * b).sum::<f64>()
            };
            let mut xd: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
            if let Some(g) = norm {
                let mean_square = xd.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
                let scale = 1.0 / (mean_square + MOE_NORM_EPS as f64).sqrt();
                for (v, &g) in xd.iter_mut().zip(g) {
                    *v *= scale * g as f64;
                }
            }
            let act: Vec<f64> = (0..width)
                .map(|i| {
                    let g = dot(&gate_up[(e * 2 * width + i) * hidden..][..hidden], &xd);
                    let u = dot(
                        &gate_up[(e * 2 * width + width + i) * hidden..][..hidden],
                        &xd,
                    );
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for h in 0..hidden {
                out[t * hidden + h] +=
                    weight * dot(&down[(e * hidden + h) * width..][..width], &act);
            }
        }
    }
    (ids, out)
}

/// Runs a MoE layer on the device: route, gate and up with SwiGLU (the RMS norm by `norm`'s
/// weight inside, where given), down, combine into `residual` (`x`, or zeros for a rank's
/// partial sum), the experts `routing.held` in the tables. Returns the experts chosen per
/// pair, the tile list and order, and the residual.
struct MoeRun {
    ids: Vec<i32>,
    tiles: Vec<i32>,
    order: Vec<i32>,
    out: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn run_moe(
    ctx: &Ctx,
    logits: &[f32],
    (x, residual): (&[f32], &[f32]),
    (gate_up, down): (&DeviceBuffer, &DeviceBuffer),
    routing: cuda::Routing,
    (hidden, width): (usize, usize),
    road: cuda::ExpertRoad,
    norm: Option<&DeviceBuffer>,
) -> MoeRun {
    let (experts, k) = (routing.experts, routing.top_k);
    let tokens = logits.len() / experts;
    let pairs = tokens * k;
    let gate_up_mat =
        DevMat::from_slice(gate_up.as_slice::<bf16>(), experts * 2 * width, hidden).unwrap();
    let down_mat = DevMat::from_slice(down.as_slice::<bf16>(), experts * hidden, width).unwrap();
    let held = routing.held.first..routing.held.first + routing.held.count;
    let first: Vec<Vec<DevMat<'_>>> = held
        .clone()
        .map(|e| {
            let base = e * 2 * width;
            vec![
                gate_up_mat.slice_rows(base..base + width),
                gate_up_mat.slice_rows(base + width..base + 2 * width),
            ]
        })
        .collect();
    let second: Vec<Vec<DevMat<'_>>> = held
        .map(|e| vec![down_mat.slice_rows(e * hidden..(e + 1) * hidden)])
        .collect();
    // SAFETY: the weight buffers outlive the tables (all live until this function returns).
    let (gate_up_table, down_table) = unsafe {
        (
            cuda::ExpertTable::new(&ctx.device, &ctx.owner, "gate/up", &first).unwrap(),
            cuda::ExpertTable::new(&ctx.device, &ctx.owner, "down", &second).unwrap(),
        )
    };
    let logits_buf = ctx.upload(logits);
    let x_buf = ctx.upload(x);
    let mut buffers = RouteBuffers::new(ctx, &routing, tokens, road);
    let mut act = ctx.poisoned::<f32>(pairs * width);
    let mut expert_out = ctx.poisoned::<f32>(pairs * hidden);
    let mut out = ctx.upload(residual);
    let mut routes = buffers.routes(road);
    let dev = &ctx.device;
    cuda::moe_route(dev, logits_buf.as_slice(), tokens, &routing, &mut routes).unwrap();
    let t = routes.tiles(&routing, tokens);
    let norm = norm.map(|g| MatvecNorm {
        weight: g.as_slice(),
        eps: MOE_NORM_EPS,
    });
    if road == cuda::ExpertRoad::TensorCores {
        assert!(norm.is_none(), "experts_mma has no norm form");
        let (act_out, x) = (&mut act.as_mut_slice(), x_buf.as_slice());
        cuda::experts_mma(dev, &gate_up_table, t, x, k, act_out).unwrap();
        let out = &mut expert_out.as_mut_slice();
        cuda::experts_mma(dev, &down_table, t, act.as_slice(), 1, out).unwrap();
    } else {
        let (act_out, x) = (&mut act.as_mut_slice(), x_buf.as_slice());
        cuda::matvec_experts(dev, &gate_up_table, t, x, k, norm, act_out).unwrap();
        let out = &mut expert_out.as_mut_slice();
        cuda::matvec_experts(dev, &down_table, t, act.as_slice(), 1, None, out).unwrap();
    }
    let routed = (routes.weights.as_slice(), routes.ids.as_slice());
    cuda::moe_combine(
        dev,
        routed,
        routing.held,
        expert_out.as_slice(),
        k,
        &mut out.as_mut_slice(),
        hidden,
    )
    .unwrap();
    MoeRun {
        ids: ctx.download(&buffers.ids),
        tiles: ctx.download(&buffers.tiles),
        order: ctx.download(&buffers.order),
        out: ctx.download(&out),
    }
}

/// Routing alone, for every size of expert set the kernel keeps in registers (up to 128, 256,
/// 512 and 1024 experts a token): the experts chosen and their weights, for one token (decode's
/// one-warp routing) and for a few.
#[test]
fn moe_routing_takes_every_size_of_expert_set() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(5);
    for experts in [60, 200, 512, 1024] {
        let routing = cuda::Routing::new(experts, 8, true);
        for tokens in [1, 5] {
            let logits: Vec<f32> = rng.vec(tokens * experts).iter().map(|v| v * 4.0).collect();
            let (want_ids, want_weights): (Vec<i32>, Vec<f64>) = logits
                .chunks(experts)
                .flat_map(|row| reference_routes(row, routing))
                .map(|(e, weight)| (e as i32, weight))
                .unzip();
            let road = if tokens == 1 {
                ExpertRoad::Decode
            } else {
                ExpertRoad::Matvec
            };
            let logits_buf = ctx.upload(&logits);
            let mut buffers = RouteBuffers::new(&ctx, &routing, tokens, road);
            let logits = logits_buf.as_slice();
            let mut routes = buffers.routes(road);
            cuda::moe_route(&ctx.device, logits, tokens, &routing, &mut routes).unwrap();
            let what = format!("{experts} experts, {tokens} tokens");
            assert_eq!(ctx.download::<i32>(&buffers.ids), want_ids, "{what}");
            let got = ctx.download::<f32>(&buffers.weights);
            let err = rel_err(&got, &want_weights);
            assert!(err < 1e-5, "{what}: weights off by {err:e}");
        }
    }
}

#[test]
fn moe_routes_on_the_device_and_matches_the_reference() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(11);
    // Tiny (the golden fixtures' shape), and Qwen3-30B-A3B's routing (128 experts, top 8)
    // over narrow experts; one token (decode: a tile per pair) and batches (tiles of 8, and
    // of 64 on the tensor cores).
    for (experts, top_k, normalize, hidden, width) in
        [(8, 2, false, 64, 32), (128, 8, true, 256, 96)]
    {
        let routing = cuda::Routing::new(experts, top_k, normalize);
        let gate_up: Vec<bf16> = round(&rng.vec(experts * 2 * width * hidden));
        let down: Vec<bf16> = round(&rng.vec(experts * hidden * width));
        let (gate_up_f, down_f) = (widen(&gate_up), widen(&down));
        let (gate_up_buf, down_buf) = (ctx.upload(&gate_up), ctx.upload(&down));
        let norm: Vec<f32> = rng.vec(hidden).iter().map(|v| 0.5 + v.abs()).collect();
        let norm_buf = ctx.upload(&norm);
        let roads = |tokens: usize| match tokens {
            1 => vec![ExpertRoad::Decode],
            2..=8 => vec![ExpertRoad::Matvec],
            _ => vec![ExpertRoad::Matvec, ExpertRoad::TensorCores],
        };
        // 300 tokens of top 2 of 8: each expert's pairs fill more than one tile of 64.
        // One token twice: with ties, and with its experts picked out of index order (which
        // decode's one-warp routing must sort as the batch routing does).
        for (case, tokens) in [1, 1, 3, 37, 300].into_iter().enumerate() {
            let mut logits: Vec<f32> = rng.vec(tokens * experts).iter().map(|v| v * 4.0).collect();
            // The last token's logits all equal: the lowest indices win the ties.
            let ties = case != 1;
            if ties {
                logits[(tokens - 1) * experts..].fill(0.5);
            } else {
                // A permutation of the experts' order (3 is prime to their count).
                for (e, l) in logits.iter_mut().enumerate() {
                    *l = ((e * 3) % experts) as f32 * 0.05;
                }
            }
            let x = rng.vec(tokens * hidden);
            // Gate/up read x as it is, or (the matrix-vector roads) normalise it themselves.
            let cases = roads(tokens).into_iter().flat_map(|road| {
                let normed = (road != ExpertRoad::TensorCores).then_some((road, true));
                [(road, false)].into_iter().chain(normed)
            });
            for (road, normed) in cases {
                let (norm, norm_buf) = if normed {
                    (Some(&norm[..]), Some(&norm_buf))
                } else {
                    (None, None)
                };
                let (ids, want) = moe_reference(
                    &logits, &x, &gate_up_f, &down_f, routing, hidden, width, norm,
                );
                let tail: Vec<i32> = (0..top_k as i32).collect();
                let last = &ids[(tokens - 1) * top_k..];
                if ties {
                    assert_eq!(last, &tail[..], "reference ties");
                } else {
                    assert!(!last.is_sorted(), "{last:?}: experts picked in index order");
                }
                let weights = (&gate_up_buf, &down_buf);
                let shape = (hidden, width);
                let xs = (&x[..], &x[..]);
                let run = run_moe(&ctx, &logits, xs, weights, routing, shape, road, norm_buf);
                let what = format!(
                    "{experts} experts top {top_k}, {tokens} tokens, {road:?}, norm {normed}"
                );
                assert_eq!(run.ids, ids, "{what}: experts chosen");
                // The tensor cores take x and the activations rounded to bf16.
                let tolerance = if road == ExpertRoad::TensorCores {
                    1e-2
                } else {
                    1e-5
                };
                let err = rel_err(&run.out, &want);
                assert!(err < tolerance, "{what}: error {err:e}");

                // The tiles: each expert's pairs in pair order, experts ascending, every
                // pair once.
                let tile_rows = road.tile_rows();
                let mut seen = Vec::new();
                for tile in run.tiles[1..].chunks(3).take(run.tiles[0] as usize) {
                    let (e, first, n) = (tile[0], tile[1] as usize, tile[2] as usize);
                    assert!((1..=tile_rows).contains(&n), "{what}: tile of {n}");
                    for &p in &run.order[first..first + n] {
                        assert_eq!(ids[p as usize], e, "{what}: pair {p} in expert {e}'s tile");
                        seen.push((e, p));
                    }
                }
                let mut sorted = seen.clone();
                sorted.sort();
                assert_eq!(seen, sorted, "{what}: tiles out of order");
                assert_eq!(seen.len(), tokens * top_k, "{what}: pairs in tiles");

                // A token's output alone is its output in the batch, bit for bit, on the same
                // road (and on the decode road, for the matrix-vector one).
                if tokens > 1 {
                    let t = tokens / 2;
                    let mut alone_roads = vec![road];
                    if road == ExpertRoad::Matvec {
                        alone_roads.push(ExpertRoad::Decode);
                    }
                    for alone_road in alone_roads {
                        let xt = &x[t * hidden..(t + 1) * hidden];
                        let alone = run_moe(
                            &ctx,
                            &logits[t * experts..(t + 1) * experts],
                            (xt, xt),
                            weights,
                            routing,
                            shape,
                            alone_road,
                            norm_buf,
                        );
                        assert_eq!(
                            bits(&alone.out),
                            bits(&run.out[t * hidden..(t + 1) * hidden]),
                            "{what}: token {t} alone on {alone_road:?}"
                        );
                    }
                }
            }
        }
    }
}

/// Expert parallelism's kernels: each rank's tables hold a share of the experts, its routing
/// tiles only their pairs (naming each expert by its place in the share) and its combine adds
/// only theirs, into a partial sum. The ranks' partial sums added in rank order to the
/// residual are the whole layer's output, on every road, for shares of 2 and 4 ranks.
#[test]
fn moe_shares_of_the_experts_add_up_to_the_whole() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(23);
    for (experts, top_k, hidden, width) in [(8, 2, 64, 32), (128, 8, 256, 96)] {
        let routing = cuda::Routing::new(experts, top_k, true);
        let gate_up: Vec<bf16> = round(&rng.vec(experts * 2 * width * hidden));
        let down: Vec<bf16> = round(&rng.vec(experts * hidden * width));
        let (gate_up_buf, down_buf) = (ctx.upload(&gate_up), ctx.upload(&down));
        let weights = (&gate_up_buf, &down_buf);
        let shape = (hidden, width);
        for tokens in [1, 37, 300] {
            let logits: Vec<f32> = rng.vec(tokens * experts).iter().map(|v| v * 4.0).collect();
            let x = rng.vec(tokens * hidden);
            let zeros = vec![0f32; x.len()];
            let roads = match tokens {
                1 => vec![ExpertRoad::Decode],
                _ => vec![ExpertRoad::Matvec, ExpertRoad::TensorCores],
            };
            for road in roads {
                let whole = run_moe(&ctx, &logits, (&x, &x), weights, routing, shape, road, None);
                for ranks in [2, 4] {
                    let what =
                        format!("{experts} experts, {tokens} tokens, {road:?}, {ranks} ranks");
                    let mut sum = x.clone();
                    let mut pairs_tiled = 0;
                    for rank in 0..ranks {
                        let (first, end) = (experts * rank / ranks, experts * (rank + 1) / ranks);
                        let share = routing.holding(first, end - first);
                        let run = run_moe(
                            &ctx,
                            &logits,
                            (&x, &zeros),
                            weights,
                            share,
                            shape,
                            road,
                            None,
                        );
                        assert_eq!(run.ids, whole.ids, "{what}: rank {rank}'s routing");
                        let mut seen = Vec::new();
                        for tile in run.tiles[1..].chunks(3).take(run.tiles[0] as usize) {
                            let (e, at, n) = (tile[0] as usize, tile[1] as usize, tile[2] as usize);
                            assert!(e < end - first, "{what}: rank {rank} tiles expert {e}");
                            for &p in &run.order[at..at + n] {
                                assert_eq!(run.ids[p as usize] as usize, first + e, "{what}");
                                seen.push(p);
                            }
                        }
                        let held = |&id: &i32| (first..end).contains(&(id as usize));
                        assert_eq!(
                            seen.len(),
                            run.ids.iter().filter(|id| held(id)).count(),
                            "{what}: rank {rank}'s pairs in tiles"
                        );
                        pairs_tiled += seen.len();
                        for (s, p) in sum.iter_mut().zip(&run.out) {
                            *s += p;
                        }
                    }
                    assert_eq!(
                        pairs_tiled,
                        tokens * top_k,
                        "{what}: every pair on one rank"
                    );
                    let want: Vec<f64> = whole.out.iter().map(|&v| v as f64).collect();
                    let err = rel_err(&sum, &want);
                    assert!(
                        err < 1e-5,
                        "{what}: the ranks' sum off the whole by {err:e}"
                    );
                }
            }
        }
    }
}
