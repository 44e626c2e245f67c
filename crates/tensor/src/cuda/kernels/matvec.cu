// Decode matrix-vector products: y[b, r] = sum_c W[r, c] * x[b, c] (+ y[b, r]), b < B.
//
// W is [rows, cols] row-major (a HF Linear), f32, bf16 or f16; x and y are f32. A group of
// `wpr` warps (1, 2, 4 or 8, set by the host from the row length) takes ROWS rows and splits
// their columns: each thread streams 16 bytes of every row per step (consecutive threads,
// consecutive bytes) and reuses each x value it loads across the ROWS rows. So the weights
// move once at full width, the activations come from L1, long rows are shared by enough
// threads to keep many loads in flight, and short rows do not leave threads idle. Sums are
// f32, reduced across each warp by shuffles and across a group's warps in shared memory.

#define MATVEC_THREADS 256

// `vec` (set by the host) says every row and x start on 16 bytes and cols is a whole number
// of chunks; otherwise the scalar loop runs.
template <typename W, int B, int ROWS, int UNROLL>
__device__ __forceinline__ void matvec(const W* __restrict__ w, const float* __restrict__ x,
                                       float* __restrict__ y, int rows, int cols, int accumulate,
                                       int vec, int wpr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = (MATVEC_THREADS / 32) / wpr;
    const int row0 = (blockIdx.x * groups + warp / wpr) * ROWS;
    // This thread's place in its group, and the group's width in threads.
    const int tg = (warp % wpr) * 32 + lane, width = wpr * 32;
    float acc[ROWS][B];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;
    // Rows past the last re-read it; their sums are dropped below.
    const W* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = w + (size_t)min(row0 + r, rows - 1) * cols;

    if (vec) {
        const int N = Chunk<W>::N;
        const int chunks = cols / N;
#pragma unroll UNROLL
        for (int c = tg; c < chunks; c += width) {
            float wf[ROWS][N];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) Chunk<W>::unpack(load_stream16(wr[r] + c * N), wf[r]);
#pragma unroll
            for (int b = 0; b < B; ++b) {
                float xv[N];
#pragma unroll
                for (int i = 0; i < N; i += 4) {
                    const float4 v = load_f4(x + (size_t)b * cols + c * N + i);
                    xv[i] = v.x;
                    xv[i + 1] = v.y;
                    xv[i + 2] = v.z;
                    xv[i + 3] = v.w;
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
#pragma unroll
                    for (int i = 0; i < N; ++i) acc[r][b] = fmaf(wf[r][i], xv[i], acc[r][b]);
            }
        }
    } else {
        for (int c = tg; c < cols; c += width) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float wv = to_f32(wr[r][c]);
#pragma unroll
                for (int b = 0; b < B; ++b) acc[r][b] = fmaf(wv, x[(size_t)b * cols + c], acc[r][b]);
            }
        }
    }

    __shared__ float partial[MATVEC_THREADS / 32][ROWS * B];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float s = warp_sum(acc[r][b]);
            if (lane == 0) partial[warp][r * B + b] = s;
        }
    __syncthreads();
    if (threadIdx.x < groups * ROWS * B) {
        const int g = threadIdx.x / (ROWS * B), i = threadIdx.x % (ROWS * B);
        const int r = (blockIdx.x * groups + g) * ROWS + i / B, b = i % B;
        float sum = 0.0f;
        for (int w = 0; w < wpr; ++w) sum += partial[g * wpr + w][i];
        if (r < rows) {
            float* out = y + (size_t)b * rows + r;
            *out = accumulate ? *out + sum : sum;
        }
    }
}

// More rows per group at larger batches, so each x load feeds more FMAs; fewer steps unrolled
// there, so the registers still leave room for two blocks per multiprocessor.
#define MATVEC(NAME, W, B, ROWS, UNROLL)                                                       \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                               \
        NAME(const W* w, const float* x, float* y, int rows, int cols, int accumulate,          \
             int vec, int wpr) {                                                               \
        matvec<W, B, ROWS, UNROLL>(w, x, y, rows, cols, accumulate, vec, wpr);                  \
    }
#define MATVEC_ALL_BATCHES(T, W)              \
    MATVEC(matvec_##T##_b1, W, 1, 2, 4)       \
    MATVEC(matvec_##T##_b2, W, 2, 2, 4)       \
    MATVEC(matvec_##T##_b3, W, 3, 4, 2)       \
    MATVEC(matvec_##T##_b4, W, 4, 4, 2)       \
    MATVEC(matvec_##T##_b5, W, 5, 4, 1)       \
    MATVEC(matvec_##T##_b6, W, 6, 4, 1)       \
    MATVEC(matvec_##T##_b7, W, 7, 4, 1)       \
    MATVEC(matvec_##T##_b8, W, 8, 4, 1)

MATVEC_ALL_BATCHES(f32, float)
MATVEC_ALL_BATCHES(bf16, bf16_t)
MATVEC_ALL_BATCHES(f16, f16_t)
