// A mixture-of-experts layer's prompt products on the tensor cores (sm_80 and later). For each
// tile of up to 64 routed pairs of one expert (moe_route with tiles of 64), and 64 output rows
// per block: y[p] = W_e · x[p / x_div], or with two matrices (gate and up) y[p] =
// silu(W_gate · x) · (W_up · x). The matrices are bf16 (read through the expert table as in
// matvec.cu), x is f32 rounded to bf16 as it is staged (as the prompt GEMMs round their input),
// and every sum is f32.
//
// A block of 4 warps steps through the row length 32 values at a time: the tile's x rows
// (gathered by pair) and the block's weight rows go to shared memory as bf16, and each warp
// multiplies its 16 pairs by the 64 weight rows (8 m16n8k16 products per 16 values, per
// matrix). A pair's sums depend only on its own x row, so a token's result does not depend on
// the other tokens of its tile. Rows past the tile's pairs re-read its last pair and are not
// written; the host guarantees cols is a multiple of 32 and rows of 16 bytes.

#define XM_PAIRS 64
#define XM_ROWS 64
#define XM_K 32
#define XM_THREADS 128
// Padding of a shared row in bf16 values (16 bytes): the 8 rows a fragment load touches start
// in different bank quads.
#define XM_PAD 8

template <int M>
__device__ __forceinline__ void experts_mma(const float* __restrict__ x, float* __restrict__ y,
                                            const int* __restrict__ tiles,
                                            const int* __restrict__ order,
                                            const unsigned long long* __restrict__ experts,
                                            int rows, int cols, int x_div) {
    __shared__ __align__(16) unsigned short xs[XM_PAIRS][XM_K + XM_PAD];
    __shared__ __align__(16) unsigned short ws[M][XM_ROWS][XM_K + XM_PAD];
    __shared__ int pair_of[XM_PAIRS];
    const int tile = blockIdx.y;
    if (tile >= tiles[0]) return;  // the grid covers the most tiles a routing can make
    const int* t = tiles + 1 + 3 * tile;
    const int expert = t[0], first = t[1], count = t[2];
    const int n0 = blockIdx.x * XM_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    if (threadIdx.x < XM_PAIRS) pair_of[threadIdx.x] = order[first + min((int)threadIdx.x, count - 1)];
    float acc[M][XM_ROWS / 8][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int j = 0; j < XM_ROWS / 8; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;
    __syncthreads();

    // What this thread stages per step: X_LOADS 4-float pieces of x rows and W_LOADS 8-value
    // pieces of each matrix's rows, at fixed places of the tile (consecutive threads,
    // consecutive bytes). The next step's pieces are loaded into registers while the tensor
    // cores work on this one's, so the loads' latency hides behind the products.
    constexpr int X_LOADS = XM_PAIRS * XM_K / 4 / XM_THREADS, W_LOADS = XM_ROWS * XM_K / 8 / XM_THREADS;
    const int x_row = threadIdx.x / (XM_K / 4), x_col = (threadIdx.x % (XM_K / 4)) * 4;
    const int w_row = threadIdx.x / (XM_K / 8), w_col = (threadIdx.x % (XM_K / 8)) * 8;
    constexpr int X_STEP = XM_THREADS / (XM_K / 4), W_STEP = XM_THREADS / (XM_K / 8);
    const float* xp[X_LOADS];
#pragma unroll
    for (int i = 0; i < X_LOADS; ++i) xp[i] = x + (size_t)(pair_of[x_row + i * X_STEP] / x_div) * cols + x_col;
    const unsigned short* wp[M][W_LOADS];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const unsigned short* w = (const unsigned short*)experts[expert * M + m];
#pragma unroll
        for (int i = 0; i < W_LOADS; ++i)
            wp[m][i] = w + (size_t)min(n0 + w_row + i * W_STEP, rows - 1) * cols + w_col;
    }
    float4 xv[X_LOADS];
    uint4 wv[M][W_LOADS];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < X_LOADS; ++i) xv[i] = load_f4(xp[i] + k0);
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int i = 0; i < W_LOADS; ++i) wv[m][i] = load_stream16(wp[m][i] + k0);
    };

    fetch(0);
    for (int k0 = 0; k0 < cols; k0 += XM_K) {
#pragma unroll
        for (int i = 0; i < X_LOADS; ++i)
            *(uint2*)&xs[x_row + i * X_STEP][x_col] =
                make_uint2(pack_bf16(xv[i].x, xv[i].y), pack_bf16(xv[i].z, xv[i].w));
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int i = 0; i < W_LOADS; ++i) *(uint4*)&ws[m][w_row + i * W_STEP][w_col] = wv[m][i];
        __syncthreads();
        if (k0 + XM_K < cols) fetch(k0 + XM_K);
#pragma unroll
        for (int kk = 0; kk < XM_K; kk += 16) {
            const int r = warp * 16 + g, c = kk + 2 * tq;
            unsigned a[4];
            a[0] = *(const unsigned*)&xs[r][c];
            a[1] = *(const unsigned*)&xs[r + 8][c];
            a[2] = *(const unsigned*)&xs[r][c + 8];
            a[3] = *(const unsigned*)&xs[r + 8][c + 8];
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int j = 0; j < XM_ROWS / 8; ++j) {
                    const unsigned short* wr = &ws[m][j * 8 + g][c];
                    mma_bf16(acc[m][j], a, *(const unsigned*)wr, *(const unsigned*)(wr + 8));
                }
        }
        __syncthreads();  // the tiles are read before the next step overwrites them
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + g + half * 8;
        if (r >= count) continue;
        float* out = y + (size_t)pair_of[r] * rows;
#pragma unroll
        for (int j = 0; j < XM_ROWS / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int n = n0 + j * 8 + 2 * tq + c;
                if (n >= rows) continue;
                float v = acc[0][j][half * 2 + c];
                if (M == 2) v = silu(v) * acc[M - 1][j][half * 2 + c];
                out[n] = v;
            }
    }
}

extern "C" __global__ void __launch_bounds__(XM_THREADS)
    experts_mma_bf16(const float* x, float* y, const int* tiles, const int* order,
                     const unsigned long long* experts, int rows, int cols, int x_div) {
    grid_dependency_wait();
    experts_mma<1>(x, y, tiles, order, experts, rows, cols, x_div);
}

extern "C" __global__ void __launch_bounds__(XM_THREADS)
    experts_mma_bf16_swiglu(const float* x, float* y, const int* tiles, const int* order,
                            const unsigned long long* experts, int rows, int cols, int x_div) {
    grid_dependency_wait();
    experts_mma<2>(x, y, tiles, order, experts, rows, cols, x_div);
}
