// Element-wise kernels over flat arrays, grid-stride loops.

// out[i] = silu(gate[i]) * up[i] (SwiGLU); out may alias gate.
template <typename O>
__device__ __forceinline__ void silu_mul(const float* gate, const float* __restrict__ up, O* out,
                                         long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = from_f32<O>(silu(gate[i]) * up[i]);
    }
}

extern "C" __global__ void silu_mul_f32(const float* gate, const float* up, float* out,
                                        long long n) {
    grid_dependency_wait();
    silu_mul<float>(gate, up, out, n);
}

extern "C" __global__ void silu_mul_bf16(const float* gate, const float* up, bf16_t* out,
                                         long long n) {
    grid_dependency_wait();
    silu_mul<bf16_t>(gate, up, out, n);
}

// x[i] += y[i].
extern "C" __global__ void add_f32(float* x, const float* __restrict__ y, long long n) {
    grid_dependency_wait();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
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
