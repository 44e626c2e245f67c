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
//      index into order, pairs) per tile. Each expert's run is gathered by one thread that
//      scans the pairs in order, so the grouping never depends on timing.
//
// moe_combine: out[t] = sum over ranks r of weight[t, r] · expert_out[t · top_k + r], in rank
// order, one thread per output value.

#define MOE_THREADS 1024
#define MOE_MAX_EXPERTS 1024  // 32 per lane: `taken` is a 32-bit mask
#define MOE_NO_EXPERT 0x7fffffff

extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_route(const float* __restrict__ logits, int tokens, int experts, int top_k, int normalize,
              int tile_rows, int* __restrict__ ids, float* __restrict__ weights,
              int* __restrict__ order, int* __restrict__ tiles) {
    __shared__ int runs[MOE_MAX_EXPERTS];  // pairs per expert, then where its run starts
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

    for (int t = warp; t < tokens; t += warps) {
        const float* row = logits + (size_t)t * experts;
        float m = NEG_INF;
        for (int e = lane; e < experts; e += 32) m = fmaxf(m, row[e]);
        m = warp_max(m);
        float sum = 0.0f;
        for (int e = lane; e < experts; e += 32) sum += expf(row[e] - m);
        sum = warp_sum(sum);
        unsigned taken = 0;  // bit i: expert lane + 32·i is chosen already
        float total = 0.0f, mine = 0.0f;
        int mine_id = 0;
        for (int r = 0; r < top_k; ++r) {
            float best = -1.0f;  // below every probability; NaN never wins
            int best_id = MOE_NO_EXPERT;
            for (int i = 0, e = lane; e < experts; ++i, e += 32) {
                if ((taken >> i) & 1u) continue;
                const float p = expf(row[e] - m) / sum;
                if (p > best) {  // e rises, so the first of equal values stays
                    best = p;
                    best_id = e;
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
            }
            if ((best_id & 31) == lane) taken |= 1u << (best_id >> 5);
            if (lane == r) {
                mine = best;
                mine_id = best_id;
            }
            total += best;
        }
        if (lane < top_k) {
            ids[t * top_k + lane] = mine_id;
            weights[t * top_k + lane] = normalize ? mine / total : mine;
        }
    }
    __syncthreads();  // every pair's expert is written (global writes of this block)

    const int pairs = tokens * top_k;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int n = 0;
        for (int p = 0; p < pairs; ++p) n += ids[p] == e;
        runs[e] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int count = 0, start = 0;
        for (int e = 0; e < experts; ++e) {
            const int n = runs[e];
            for (int j = 0; j < n; j += tile_rows) {
                int* tile = tiles + 1 + 3 * count++;
                tile[0] = e;
                tile[1] = start + j;
                tile[2] = min(tile_rows, n - j);
            }
            runs[e] = start;
            start += n;
        }
        tiles[0] = count;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int at = runs[e];
        for (int p = 0; p < pairs; ++p)
            if (ids[p] == e) order[at++] = p;
    }
}

extern "C" __global__ void moe_combine(const float* __restrict__ expert_out,
                                       const float* __restrict__ weights, int tokens, int top_k,
                                       int hidden, float* __restrict__ out) {
    const size_t n = (size_t)tokens * hidden;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / hidden, h = i % hidden;
        float s = 0.0f;
        for (int r = 0; r < top_k; ++r) {
            const size_t p = t * top_k + r;
            s = fmaf(weights[p], expert_out[p * hidden + h], s);
        }
        out[i] = s;
    }
}
