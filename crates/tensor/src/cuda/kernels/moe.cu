// Mixture-of-experts routing on the device, so no layer waits for the host to learn a choice.
//
// moe_route, one block for the whole batch:
//   1. each token's router logits become probabilities (softmax), and its top_k experts are
//      picked by repeated arg-max, the lower expert index winning ties as torch.topk does,
//      one warp per token; their probabilities, divided by their sum with `normalize`
//      (Qwen3-MoE's norm_topk_prob), are the pair weights. Pair p = token · top_k + rank.
//   2. the pairs are grouped by expert for matvec's `_experts` kernels: `order` lists each
//      expert's pairs in pair order (expert 0's first), and `tiles` cuts each expert's run
//      into tiles of at most `tile_rows` pairs: tiles[0] is their count, then (expert, first
//      index into order, pairs) per tile. Where each expert's pairs and tiles start are sums
//      over the experts before it; one warp places the pairs 32 at a time in pair order, so
//      the grouping never depends on timing.
// The block takes a warp per token for step 1 and a thread per expert for step 2, so the host
// sizes it to the batch and the experts. A single token with a tile per pair (decode) takes
// one warp for both, from registers.
//
// Only the experts held here, [held_first, held_end), get tiles (naming an expert by its
// place among them, the expert table's index): under expert parallelism each rank holds a
// share of the experts, and the others' pairs are another rank's to compute.
//
// moe_combine: out[t] += sum over ranks r of weight[t, r] · expert_out[t · top_k + r], in rank
// order over the pairs of held experts, one thread per output value: the layer's output added
// to the residual stream (or to a rank's partial sum).

#define MOE_THREADS 1024
#define MOE_MAX_EXPERTS 1024
#define MOE_PER_LANE (MOE_MAX_EXPERTS / 32)
#define MOE_NO_EXPERT 0x7fffffff

// One token's top_k experts by one warp, from its router logits `row`: lane r < top_k gets
// rank r's expert and weight. PER_LANE: experts a lane holds, at least experts / 32.
template <int PER_LANE>
__device__ __forceinline__ void pick_experts(const float* __restrict__ row, int experts,
                                             int top_k, int normalize, int lane, int& mine_id,
                                             float& weight) {
    // Lane l holds experts l, l + 32, ...; the probabilities stay in registers (sized to the
    // experts: room for 1024 everywhere put them in local memory, and the prompt's routing
    // spilled).
    float prob[PER_LANE];
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int e = lane + 32 * i;
        prob[i] = e < experts ? row[e] : NEG_INF;
        m = fmaxf(m, prob[i]);
    }
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
        if (lane + 32 * i < experts) sum += expf(prob[i] - m);
    sum = warp_sum(sum);
    // Taken and absent experts read -1, below every probability; NaN never wins.
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
        prob[i] = lane + 32 * i < experts ? expf(prob[i] - m) / sum : -1.0f;
    float total = 0.0f, mine = 0.0f;
    mine_id = 0;
    for (int r = 0; r < top_k; ++r) {
        float best = -1.0f;
        int best_id = MOE_NO_EXPERT;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            if (prob[i] > best) {  // experts rise with i, so the first of equals stays
                best = prob[i];
                best_id = lane + 32 * i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, best, o);
            const int oi = __shfl_xor_sync(FULL_MASK, best_id, o);
            if (ov > best || (ov == best && oi < best_id)) {
                best = ov;
                best_id = oi;
            }
        }
        if (best_id == MOE_NO_EXPERT) {  // only NaN left: any valid expert, weight 0
            best_id = r;
            best = 0.0f;
        } else if ((best_id & 31) == lane) {
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i)
                if (i == (best_id >> 5)) prob[i] = -1.0f;
        }
        if (lane == r) {
            mine = best;
            mine_id = best_id;
        }
        total += best;
    }
    weight = normalize ? mine / total : mine;
}

// pick_experts with registers for `experts` (at most MOE_MAX_EXPERTS).
__device__ __forceinline__ void pick_top_k(const float* __restrict__ row, int experts, int top_k,
                                           int normalize, int lane, int& id, float& weight) {
    if (experts <= 128)
        pick_experts<4>(row, experts, top_k, normalize, lane, id, weight);
    else if (experts <= 256)
        pick_experts<8>(row, experts, top_k, normalize, lane, id, weight);
    else if (experts <= 512)
        pick_experts<16>(row, experts, top_k, normalize, lane, id, weight);
    else
        pick_experts<MOE_PER_LANE>(row, experts, top_k, normalize, lane, id, weight);
}

extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_route(const float* __restrict__ logits, int tokens, int experts, int top_k, int normalize,
              int tile_rows, int held_first, int held_end, int* __restrict__ ids,
              float* __restrict__ weights,
              int* __restrict__ order, int* __restrict__ tiles) {
    grid_dependency_wait();
    __shared__ int run_start[MOE_MAX_EXPERTS];   // pairs per expert, then where its run starts
    __shared__ int tile_start[MOE_MAX_EXPERTS];  // each expert's first tile
    __shared__ int cursor[MOE_MAX_EXPERTS];      // each expert's next free place in `order`
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

    if (tokens == 1 && tile_rows == 1) {
        // One token, a tile per pair (decode): one warp picks the experts and lays out the
        // tiles from its registers. A pair's place is the pairs of lower experts before it
        // (and of its own expert with lower ranks, which only the all-NaN fallback makes):
        // the tiles and order the general path below makes, without its rounds of shared
        // and global memory (H200, qwen3-30b-a3b: 8.4 us a layer under Nsight Compute).
        // Only held pairs count and get a tile.
        if (warp != 0) return;
        int id;
        float weight;
        pick_top_k(logits, experts, top_k, normalize, lane, id, weight);
        const bool held = lane < top_k && id >= held_first && id < held_end;
        const unsigned held_lanes = __ballot_sync(FULL_MASK, held);
        int place = 0;
        for (int j = 0; j < top_k; ++j) {
            const int other = __shfl_sync(FULL_MASK, id, j);
            place += ((held_lanes >> j) & 1u) && (other < id || (other == id && j < lane));
        }
        if (lane < top_k) {
            ids[lane] = id;
            weights[lane] = weight;
        }
        if (held) {
            order[place] = lane;
            int* tile = tiles + 1 + 3 * place;
            tile[0] = id - held_first;
            tile[1] = place;
            tile[2] = 1;
        }
        if (lane == 0) tiles[0] = __popc(held_lanes);
        return;
    }
    for (int t = warp; t < tokens; t += warps) {
        int id;
        float weight;
        pick_top_k(logits + (size_t)t * experts, experts, top_k, normalize, lane, id, weight);
        if (lane < top_k) {
            ids[t * top_k + lane] = id;
            weights[t * top_k + lane] = weight;
        }
    }
    __syncthreads();  // every pair's expert is written (global writes of this block)

    const int pairs = tokens * top_k;
    // Pairs per expert: a sum, the same whatever order the adds land in.
    for (int e = threadIdx.x; e < experts; e += blockDim.x) run_start[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&run_start[ids[p]], 1);
    __syncthreads();
    // Where each expert's pairs and tiles start: exclusive sums over experts (tiles over the
    // held ones), lane l of warp 0 taking a contiguous share of them.
    if (warp == 0) {
        const int per = (experts + 31) / 32;
        const int lo = min(experts, lane * per), hi = min(experts, lo + per);
        int pair_sum = 0, tile_sum = 0;
        for (int e = lo; e < hi; ++e) {
            pair_sum += run_start[e];
            if (e >= held_first && e < held_end)
                tile_sum += (run_start[e] + tile_rows - 1) / tile_rows;
        }
        int pair_incl = pair_sum, tile_incl = tile_sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int p = __shfl_up_sync(FULL_MASK, pair_incl, o);
            const int t = __shfl_up_sync(FULL_MASK, tile_incl, o);
            if (lane >= o) {
                pair_incl += p;
                tile_incl += t;
            }
        }
        int p = pair_incl - pair_sum, t = tile_incl - tile_sum;
        for (int e = lo; e < hi; ++e) {
            const int n = run_start[e];
            run_start[e] = p;
            cursor[e] = p;
            tile_start[e] = t;
            p += n;
            if (e >= held_first && e < held_end) t += (n + tile_rows - 1) / tile_rows;
        }
        if (lane == 31) tiles[0] = tile_incl;
    }
    __syncthreads();
    // Each held expert's tiles, a thread per expert.
    for (int e = held_first + threadIdx.x; e < held_end; e += blockDim.x) {
        const int start = run_start[e], n = (e + 1 < experts ? run_start[e + 1] : pairs) - start;
        int* tile = tiles + 1 + 3 * tile_start[e];
        for (int j = 0; j < n; j += tile_rows, tile += 3) {
            tile[0] = e - held_first;
            tile[1] = start + j;
            tile[2] = min(tile_rows, n - j);
        }
    }
    // The pairs in order, 32 at a time by warp 0: a pair's place is its expert's next free
    // place plus the lanes before it with the same expert, so each run keeps pair order.
    if (warp == 0) {
        for (int base = 0; base < pairs; base += 32) {
            const int p = base + lane;
            const int e = p < pairs ? ids[p] : -1;
            const unsigned peers = __match_any_sync(FULL_MASK, e);
            const int before = __popc(peers & ((1u << lane) - 1u));
            if (e >= 0) order[cursor[e] + before] = p;
            __syncwarp();
            if (e >= 0 && before == __popc(peers) - 1) cursor[e] += __popc(peers);
            __syncwarp();
        }
    }
}

extern "C" __global__ void moe_combine(const float* __restrict__ expert_out,
                                       const float* __restrict__ weights,
                                       const int* __restrict__ ids, int held_first, int held_end,
                                       int tokens, int top_k, int hidden,
                                       float* __restrict__ out) {
    grid_dependency_wait();
    const size_t n = (size_t)tokens * hidden;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / hidden, h = i % hidden;
        float s = 0.0f;
        for (int r = 0; r < top_k; ++r) {
            const size_t p = t * top_k + r;
            if (ids[p] >= held_first && ids[p] < held_end)
                s = fmaf(weights[p], expert_out[p * hidden + h], s);
        }
        out[i] += s;
    }
}
