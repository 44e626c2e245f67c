// Decode matrix-vector products for b < B rows of x, registers their only staging:
//
//   y_i[b, r] = s_b · (W_i[r] · (x[b] ∘ g)) + bias_i[r]      (+ y_i[b, r] with `accumulate`)
//
// for up to three matrices W_i sharing the input x, their rows laid end to end (q, k and v),
// or with `swiglu` two (gate and up) interleaved, gate r then up r, and y_0 = silu(gate) · up.
// With `norm`, g is that RMS norm weight and s_b = 1 / rms(x[b]); else g = 1 and s_b = 1.
//
// With `norm` set, each group takes the sum of squares from the very x values it loads for
// its products (a group's lanes cover every column of x once), so the norm costs no pass of
// its own and the normalised x is never stored. With `swiglu` one group holds both rows of a
// (gate, up) pair.
//
// Longer batches run B rows per block, blockIdx.y the block of rows. The `_experts` kernels
// take a mixture-of-experts layer's routed (token, expert) pairs instead: blockIdx.y is a tile
// of up to B pairs routed to one expert (moe.cu makes the tiles), the matrices are that
// expert's, read from a table of their addresses, and pair p reads x row p / x_div and writes
// y row p. A pair's sums do not depend on the tile it shares, so a token's result is the same
// alone or in any batch.
//
// W is [rows, cols] row-major (a HF Linear), f32, bf16 or f16; x and y are f32. A group of
// `wpr` warps (1, 2, 4 or 8, set by the host from the row length) takes ROWS rows and splits
// their columns: each thread streams 16 bytes of every row per step (consecutive threads,
// consecutive bytes) and reuses each x value it loads across the ROWS rows. So the weights
// move once at full width, the activations come from L1, long rows are shared by enough
// threads to keep many loads in flight, and short rows do not leave threads idle. Sums are
// f32, reduced across each warp by shuffles and across a group's warps in shared memory.
//
// (A batch-1 form that streamed the weights through shared memory by bulk copies,
// cp.async.bulk + mbarrier in 32 KiB stages, one persistent block per multiprocessor, was
// tried on the H200 and removed: 1.6-1.9 TB/s on 4096-12288-column bf16 matrices against
// 2.8-3.6 for this form, qwen3-8b decode 103 tok/s against 180, with or without a proxy fence
// before each refill; its stages did not overlap. See git history, December 2026.)

#define MATVEC_MAX_OUTPUTS 3

// One matrix of a fused product and where its rows go.
struct MatvecOut {
    const void* w;      // [rows, cols]
    const float* bias;  // [rows] or null
    float* y;           // [B, rows]
    int rows;
    int pad;
};

// Mirrors `MatvecArgs` in matvec.rs field for field.
struct MatvecArgs {
    MatvecOut out[MATVEC_MAX_OUTPUTS];
    const float* x;     // [B, cols]
    const float* norm;  // [cols] or null
    float eps;
    int outputs;
    int total_rows;  // rows of all outputs (twice the rows of one with swiglu)
    int cols;
    int accumulate;
    int swiglu;
    int vec;  // every row and x start on 16 bytes and cols is a whole number of chunks
    int wpr;
    // The `_experts` kernels only:
    const int* tiles;  // [1 + 3·tiles]: the tile count, then (expert, first, pairs) per tile
    const int* order;  // pair indices grouped by expert; a tile's are order[first..first + pairs]
    const unsigned long long* experts;  // [experts][outputs] weight addresses (out[i].w unused)
    int x_div;         // pair p reads x row p / x_div
    int prefetch_blocks;  // blocks that may start before the kernel before ends (matvec_prefetch)
};
static_assert(sizeof(MatvecArgs) == 176, "KernelArgs in matvec.rs has 176 bytes");

__device__ __forceinline__ MatvecOut matvec_out(const MatvecArgs& a, int i) {
    return i == 0 ? a.out[0] : (i == 1 ? a.out[1] : a.out[2]);
}

// The output a row of the fused product belongs to, and the row's index there.
__device__ __forceinline__ int matvec_locate(const MatvecArgs& a, int row, int* local) {
    if (a.swiglu) {
        *local = row >> 1;
        return row & 1;
    }
    int i = 0;
    if (a.outputs > 1 && row >= a.out[0].rows) {
        row -= a.out[0].rows;
        i = 1;
        if (a.outputs > 2 && row >= a.out[1].rows) {
            row -= a.out[1].rows;
            i = 2;
        }
    }
    *local = row;
    return i;
}

// Finishes a row of the product for batch row `yb`: the norm's `scale`, the bias, then the
// epilogue. With swiglu, `row` is a gate row, `sum` its sum and `up` the sum of its up row.
__device__ __forceinline__ void matvec_store(const MatvecArgs& a, int row, float sum, float up,
                                             float scale, size_t yb) {
    if (a.swiglu) {
        const int r = row >> 1;
        float gate = sum * scale;
        up *= scale;
        if (a.out[0].bias) gate += a.out[0].bias[r];
        if (a.out[1].bias) up += a.out[1].bias[r];
        float* out = a.out[0].y + yb * a.out[0].rows + r;
        const float v = silu(gate) * up;
        *out = a.accumulate ? *out + v : v;
        return;
    }
    int local;
    const MatvecOut o = matvec_out(a, matvec_locate(a, row, &local));
    float v = sum * scale;
    if (o.bias) v += o.bias[local];
    float* out = o.y + yb * o.rows + local;
    *out = a.accumulate ? *out + v : v;
}

#define MATVEC_THREADS 256

// NORM: whether `a.norm` is set, known when compiling, so a plain product's inner loop holds
// nothing of the norm (a runtime test there cost the bf16 kernels a fifth of their speed).
// EXPERTS: the routed form (see the top of the file), also known when compiling.
// `wait`: the entry point's grid_dependency_wait(), called once the loads that need nothing
// of the kernel before are in flight.
template <typename W, int B, int ROWS, int UNROLL, bool NORM, bool EXPERTS, typename Wait>
__device__ __forceinline__ void matvec(const MatvecArgs& a, Wait wait) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wpr = a.wpr, cols = a.cols;
    const int groups = (MATVEC_THREADS / 32) / wpr;
    const int row0 = (blockIdx.x * groups + warp / wpr) * ROWS;
    // This thread's place in its group, and the group's width in threads.
    const int tg = (warp % wpr) * 32 + lane, width = wpr * 32;
    const float* __restrict__ x = a.x + (EXPERTS ? 0 : (size_t)blockIdx.y * B * cols);
    const float* __restrict__ g = a.norm;
    // A tile's expert, its first pair in `order`, its pairs, and their x rows (rows past the
    // last pair re-read it; their sums are dropped below).
    int expert = 0, first_pair = 0, count = B;
    const float* xp[B];
    if (EXPERTS) {
        wait();  // the routing kernel before wrote the tiles
        const int tile = blockIdx.y;
        if (tile >= a.tiles[0]) return;  // the grid covers the most tiles a routing can make
        const int* t = a.tiles + 1 + 3 * tile;
        expert = t[0];
        first_pair = t[1];
        count = t[2];
#pragma unroll
        for (int b = 0; b < B; ++b) xp[b] = a.x + (size_t)(a.order[first_pair + min(b, count - 1)] / a.x_div) * cols;
    }
    auto xrow = [&](int b) -> const float* { return EXPERTS ? xp[b] : x + (size_t)b * cols; };
    float acc[ROWS][B], ss[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
        ss[b] = 0.0f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r][b] = 0.0f;
    }
    // Rows past the last re-read it; their sums are dropped below.
    const W* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        int local;
        const int i = matvec_locate(a, min(row0 + r, a.total_rows - 1), &local);
        const void* w = EXPERTS ? (const void*)a.experts[expert * a.outputs + i] : matvec_out(a, i).w;
        wr[r] = (const W*)w + (size_t)local * cols;
    }

    if (a.vec) {
        const int N = Chunk<W>::N;
        const int chunks = cols / N;
        // One step: this thread's chunk c of each row (its 16 bytes `w[r]`) times x.
        auto step = [&](int c, const uint4* w) {
            float wf[ROWS][N];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) Chunk<W>::unpack(w[r], wf[r]);
            float gv[N];
            if (NORM) {
#pragma unroll
                for (int i = 0; i < N; i += 4) {
                    const float4 v = load_f4(g + c * N + i);
                    gv[i] = v.x;
                    gv[i + 1] = v.y;
                    gv[i + 2] = v.z;
                    gv[i + 3] = v.w;
                }
            }
#pragma unroll
            for (int b = 0; b < B; ++b) {
                float xv[N];
#pragma unroll
                for (int i = 0; i < N; i += 4) {
                    const float4 v = load_f4(xrow(b) + c * N + i);
                    xv[i] = v.x;
                    xv[i + 1] = v.y;
                    xv[i + 2] = v.z;
                    xv[i + 3] = v.w;
                }
                if (NORM) {
#pragma unroll
                    for (int i = 0; i < N; ++i) {
                        ss[b] = fmaf(xv[i], xv[i], ss[b]);
                        xv[i] *= gv[i];
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
#pragma unroll
                    for (int i = 0; i < N; ++i) acc[r][b] = fmaf(wf[r][i], xv[i], acc[r][b]);
            }
        };
        // The first step's weights, asked for before the wait: no kernel of the step writes
        // them, so they come while the kernel before finishes (H200: qwen3-8b decode 189 ->
        // 195-198 tok/s, qwen3-0.6b 979-1024 -> 1050-1094). All UNROLL steps held that way
        // took the registers of a block per multiprocessor.
        uint4 head[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) head[r] = tg < chunks ? load_stream16(wr[r] + tg * N) : uint4{};
        if (!EXPERTS) wait();
        if (tg < chunks) step(tg, head);
#pragma unroll UNROLL
        for (int c = tg + width; c < chunks; c += width) {
            uint4 w[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) w[r] = load_stream16(wr[r] + c * N);
            step(c, w);
        }
    } else {
        if (!EXPERTS) wait();
        for (int c = tg; c < cols; c += width) {
            const float gc = NORM ? g[c] : 1.0f;
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const float xc = xrow(b)[c];
                if (NORM) ss[b] = fmaf(xc, xc, ss[b]);
                const float xg = NORM ? xc * gc : xc;
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r][b] = fmaf(to_f32(wr[r][c]), xg, acc[r][b]);
            }
        }
    }

    __shared__ float partial[MATVEC_THREADS / 32][ROWS * B];
    __shared__ float partial_ss[MATVEC_THREADS / 32][B];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float s = warp_sum(acc[r][b]);
            if (lane == 0) partial[warp][r * B + b] = s;
        }
    if (NORM) {
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float s = warp_sum(ss[b]);
            if (lane == 0) partial_ss[warp][b] = s;
        }
    }
    __syncthreads();

    // One thread per (group, row, batch row) writes; with swiglu one per (group, row pair,
    // batch row).
    const int per_group = (a.swiglu ? ROWS / 2 : ROWS) * B;
    if (threadIdx.x >= groups * per_group) return;
    const int grp = threadIdx.x / per_group, i = threadIdx.x % per_group;
    const int b = i % B, rr = i / B;
    if (b >= count) return;
    // The row of y this batch row (or pair) writes.
    const size_t yb = EXPERTS ? (size_t)a.order[first_pair + b] : (size_t)blockIdx.y * B + b;
    const int first = grp * wpr;
    float scale = 1.0f;
    if (NORM) {
        float s = 0.0f;
        for (int w = 0; w < wpr; ++w) s += partial_ss[first + w][b];
        scale = 1.0f / sqrtf(s / (float)cols + a.eps);
    }
    const int group_row0 = (blockIdx.x * groups + grp) * ROWS;
    if (a.swiglu) {
        const int row = group_row0 + 2 * rr;  // the gate's; the up row follows it
        if (row >= a.total_rows) return;
        float gate = 0.0f, up = 0.0f;
        for (int w = 0; w < wpr; ++w) {
            gate += partial[first + w][(2 * rr) * B + b];
            up += partial[first + w][(2 * rr + 1) * B + b];
        }
        matvec_store(a, row, gate, up, scale, yb);
        return;
    }
    const int row = group_row0 + rr;
    if (row >= a.total_rows) return;
    float sum = 0.0f;
    for (int w = 0; w < wpr; ++w) sum += partial[first + w][rr * B + b];
    matvec_store(a, row, sum, 0.0f, scale, yb);
}

// Before waiting on the kernel before (grid_dependency_wait), a block of the first wave asks
// L2 for its rows of the weights, which no kernel writes: scheduled while that kernel
// finishes, it then finds its rows in the cache, their reads overlapped with the other's
// tail. One bulk prefetch per row, by a thread each. Later blocks start after the kernel
// before has ended and load at once; a prefetch there would only add requests. The host
// turns it off (prefetch_blocks 0) for matrices over half the L2, where it measured slower.
template <typename W, int ROWS>
__device__ __forceinline__ void matvec_prefetch(const MatvecArgs& a) {
    const int rows = (MATVEC_THREADS / 32) / a.wpr * ROWS;
    const int row = blockIdx.x * rows + threadIdx.x;
    if (!a.vec || blockIdx.x >= a.prefetch_blocks || threadIdx.x >= rows || row >= a.total_rows)
        return;
    int local;
    const int i = matvec_locate(a, row, &local);
    const unsigned bytes = (unsigned)a.cols * sizeof(W);  // whole 16-byte chunks with vec
    prefetch_l2((const char*)matvec_out(a, i).w + (size_t)local * bytes, bytes);
}

// More rows per group at larger batches, so each x load feeds more FMAs; fewer steps unrolled
// there, so the registers still leave room for two blocks per multiprocessor. NORM_UNROLL is
// the `_norm` form's: at batch 1 it unrolls 2 steps, not 4, which takes it from 62 registers
// (4 blocks a multiprocessor) to 48 (5) with no spill (H200, qwen3-8b decode 203 -> 208 tok/s;
// capped at 40 registers, six blocks, it spilled and qwen3-0.6b lost 8%).
#define MATVEC(NAME, W, B, ROWS, UNROLL, NORM_UNROLL)                                          \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS) NAME(const MatvecArgs a) {    \
        matvec_prefetch<W, ROWS>(a);                                                           \
        matvec<W, B, ROWS, UNROLL, false, false>(a, [] { grid_dependency_wait(); });           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS) NAME##_norm(const MatvecArgs a) { \
        matvec_prefetch<W, ROWS>(a);                                                               \
        matvec<W, B, ROWS, NORM_UNROLL, true, false>(a, [] { grid_dependency_wait(); });       \
    }
// Routed experts: one pair per tile for a decoded token (its experts differ), eight for
// prompts, where each expert takes many tokens and reads its weights once per eight. The
// `_norm` form is gate/up's, reading the residual stream itself (the layer's RMS norm inside).
#define MATVEC_EXPERTS(NAME, W, B, ROWS, UNROLL, NORM_UNROLL)                                     \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS) NAME##_experts(const MatvecArgs a) { \
        matvec<W, B, ROWS, UNROLL, false, true>(a, [] { grid_dependency_wait(); });               \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                                  \
        NAME##_experts_norm(const MatvecArgs a) {                                                 \
        matvec<W, B, ROWS, NORM_UNROLL, true, true>(a, [] { grid_dependency_wait(); });           \
    }
// (8 rows per group at batch 1, each x load feeding 8 rows, measured slower on the H200:
// qwen3-8b decode 148 tok/s against 167.)
#define MATVEC_ALL_BATCHES(T, W)                   \
    MATVEC(matvec_##T##_b1, W, 1, 2, 4, 2)         \
    MATVEC(matvec_##T##_b2, W, 2, 2, 4, 4)         \
    MATVEC(matvec_##T##_b3, W, 3, 4, 2, 2)         \
    MATVEC(matvec_##T##_b4, W, 4, 4, 2, 2)         \
    MATVEC(matvec_##T##_b5, W, 5, 4, 1, 1)         \
    MATVEC(matvec_##T##_b6, W, 6, 4, 1, 1)         \
    MATVEC(matvec_##T##_b7, W, 7, 4, 1, 1)         \
    MATVEC(matvec_##T##_b8, W, 8, 4, 1, 1)         \
    MATVEC_EXPERTS(matvec_##T##_b1, W, 1, 2, 4, 2) \
    MATVEC_EXPERTS(matvec_##T##_b8, W, 8, 4, 1, 1)

MATVEC_ALL_BATCHES(f32, float)
MATVEC_ALL_BATCHES(bf16, bf16_t)
MATVEC_ALL_BATCHES(f16, f16_t)
