// Element-wise kernels over flat arrays, grid-stride loops.

// Eight consecutive values as floats, and back (16-byte aligned).
__device__ __forceinline__ void load8(const float* p, float* v) {
    const float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16_t* p, float* v) {
    const uint4 a = *(const uint4*)p;
    const unsigned w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void store8(float* p, const float* v) {
    ((float4*)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    ((float4*)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(bf16_t* p, const float* v) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = from_f32<bf16_t>(v[2 * i]).bits | ((unsigned)from_f32<bf16_t>(v[2 * i + 1]).bits << 16);
    *(uint4*)p = make_uint4(w[0], w[1], w[2], w[3]);
}

// out[i] = silu(gate[i]) * up[i] (SwiGLU), in f32 from f32 or bf16 inputs (the bf16 ones are a
// prompt's gate/up GEMM outputs); out may alias gate. With `vec` (every pointer on 16 bytes)
// eight values a thread a step, then the tail one by one.
template <typename I, typename O>
__device__ __forceinline__ void silu_mul(const I* gate, const I* __restrict__ up, O* out,
                                         long long n, int vec) {
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        for (long long i = first; i < n / 8; i += stride) {
            float g[8], u[8];
            load8(gate + 8 * i, g);
            load8(up + 8 * i, u);
#pragma unroll
            for (int j = 0; j < 8; ++j) g[j] = silu(g[j]) * u[j];
            store8(out + 8 * i, g);
        }
        done = n / 8 * 8;
    }
    for (long long i = done + first; i < n; i += stride)
        out[i] = from_f32<O>(silu(to_f32(gate[i])) * to_f32(up[i]));
}

#define SILU_MUL(NAME, I, O)                                                          \
    extern "C" __global__ void NAME(const I* gate, const I* up, O* out, long long n, \
                                    int vec) {                                        \
        grid_dependency_wait();                                                       \
        silu_mul<I, O>(gate, up, out, n, vec);                                        \
    }
SILU_MUL(silu_mul_f32_f32, float, float)
SILU_MUL(silu_mul_f32_bf16, float, bf16_t)
SILU_MUL(silu_mul_bf16_bf16, bf16_t, bf16_t)
SILU_MUL(silu_mul_bf16_f32, bf16_t, float)

// x[i] += y[i].
extern "C" __global__ void add_f32(float* x, const float* __restrict__ y, long long n) {
    grid_dependency_wait();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// out[i] = ((parts[i] + parts[n + i]) + parts[2n + i]) + ...: a tensor-parallel group's
// partial sums, gathered rank after rank, added in rank order (the host group's order).
extern "C" __global__ void sum_parts_f32(const float* __restrict__ parts, float* out,
                                         long long n, int ranks) {
    grid_dependency_wait();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float sum = parts[i];
        for (int r = 1; r < ranks; ++r) sum += parts[(long long)r * n + i];
        out[i] = sum;
    }
}

// out[i] = (O) in[i]: activations to bf16 for a GEMM, keys and values into a 16-bit cache.
template <typename I, typename O>
__device__ __forceinline__ void convert(const I* __restrict__ in, O* __restrict__ out,
                                        long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = from_f32<O>(to_f32(in[i]));
}

#define CONVERT(NAME, I, O)                                                     \
    extern "C" __global__ void NAME(const I* in, O* out, long long n) {         \
        grid_dependency_wait();                                                 \
        convert<I, O>(in, out, n);                                              \
    }
CONVERT(convert_f32_f32, float, float)
CONVERT(convert_f32_bf16, float, bf16_t)
CONVERT(convert_f32_f16, float, f16_t)
CONVERT(convert_bf16_f32, bf16_t, float)
CONVERT(convert_f16_f32, f16_t, float)

// Rows of `width` values (a product of matrices laid end to end: q, k and v) cut into up to
// three outputs by columns: column c of a row goes to the output whose `first` .. first +
// width holds it. Four values a thread a step (every width a multiple of 4, every pointer on
// 16 bytes). Mirrors `SplitColumnsArgs` in elementwise.rs.
struct SplitOut {
    float* y;
    int first;
    int width;
};
struct SplitColumnsArgs {
    const float* src;
    SplitOut out[3];
    long long rows;
    int width;
    int outs;
};

extern "C" __global__ void split_columns_f32(const SplitColumnsArgs a) {
    grid_dependency_wait();
    const int quads = a.width / 4;
    const long long n = a.rows * quads;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / quads;
        const int col = (int)(i - row * quads) * 4;
        const int o = a.outs > 2 && col >= a.out[2].first ? 2 : a.outs > 1 && col >= a.out[1].first ? 1 : 0;
        const float4 v = *(const float4*)(a.src + row * a.width + col);
        *(float4*)(a.out[o].y + row * a.out[o].width + (col - a.out[o].first)) = v;
    }
}
