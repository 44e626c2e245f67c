// Decode matrix-vector products: y[b, r] = sum_c W[r, c] * x[b, c] (+ y[b, r]), b < B.
//
// W is [rows, cols] row-major (a HF Linear), f32, bf16 or f16; x and y are f32. A block takes
// ROWS rows and splits their columns over all its threads: each thread streams 16 bytes of
// every row per step (consecutive threads, consecutive bytes) and reuses each x value it loads
// across the ROWS rows, so the weights move once at full width, the activations come from
// L1, and even a matrix of few rows (k/v projections) gives thousands of blocks. Sums are
// f32, reduced across each warp by shuffles and across the block's warps in shared memory.

#define MATVEC_THREADS 256

// Unpacks 16 bytes of weights into N floats.
template <typename W> struct Chunk;
template <> struct Chunk<float> {
    static const int N = 4;
    static __device__ __forceinline__ void unpack(uint4 v, float* f) {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
};
template <> struct Chunk<bf16_t> {
    static const int N = 8;
    static __device__ __forceinline__ void unpack(uint4 v, float* f) {
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};
template <> struct Chunk<f16_t> {
    static const int N = 8;
    static __device__ __forceinline__ void unpack(uint4 v, float* f) {
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f16_t lo, hi;
            lo.bits = (unsigned short)(w[i] & 0xffffu);
            hi.bits = (unsigned short)(w[i] >> 16);
            f[2 * i] = to_f32(lo);
            f[2 * i + 1] = to_f32(hi);
        }
    }
};

// `vec` (set by the host) says every row and x start on 16 bytes and cols is a whole number
// of chunks; otherwise the scalar loop runs.
template <typename W, int B, int ROWS, int UNROLL>
__device__ __forceinline__ void matvec(const W* __restrict__ w, const float* __restrict__ x,
                                       float* __restrict__ y, int rows, int cols, int accumulate,
                                       int vec) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * ROWS;
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
        for (int c = threadIdx.x; c < chunks; c += MATVEC_THREADS) {
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
        for (int c = threadIdx.x; c < cols; c += MATVEC_THREADS) {
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
    if (threadIdx.x < ROWS * B) {
        const int r = threadIdx.x / B, b = threadIdx.x % B;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < MATVEC_THREADS / 32; ++w) sum += partial[w][threadIdx.x];
        if (row0 + r < rows) {
            float* out = y + (size_t)b * rows + row0 + r;
            *out = accumulate ? *out + sum : sum;
        }
    }
}

// More rows per block at larger batches, so each x load feeds more FMAs; fewer steps unrolled
// there, so the registers still leave room for two blocks per multiprocessor.
#define MATVEC(NAME, W, B, ROWS, UNROLL)                                                       \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                               \
        NAME(const W* w, const float* x, float* y, int rows, int cols, int accumulate,          \
             int vec) {                                                                        \
        matvec<W, B, ROWS, UNROLL>(w, x, y, rows, cols, accumulate, vec);                       \
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
