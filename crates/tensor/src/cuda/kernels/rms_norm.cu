// out[r] = x[r] / rms(x[r]) * weight, one block per row of d values.
//
// With `add` set the residual add is fused in front: x[r] += add[r] is written back, then
// normalised, which is the pre-norm pattern `x = x + f(x); h = norm(x)` in one pass. `out`
// may be f32 (decode) or bf16 (the input of a prefill GEMM) and may alias x.

template <typename O>
__device__ __forceinline__ void rms_norm(float* x, const float* __restrict__ add,
                                         const float* __restrict__ weight, O* out, int d,
                                         float eps) {
    float* xr = x + (size_t)blockIdx.x * d;
    O* outr = out + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = xr[i];
        if (add) {
            v += add[(size_t)blockIdx.x * d + i];
            xr[i] = v;
        }
        ss = fmaf(v, v, ss);
    }
    // Every thread reads back only the elements it wrote, after the block-wide sum.
    const float scale = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) outr[i] = from_f32<O>(weight[i] * (xr[i] * scale));
}

extern "C" __global__ void rms_norm_f32(float* x, const float* add, const float* weight,
                                        float* out, int d, float eps) {
    grid_dependency_wait();
    rms_norm<float>(x, add, weight, out, d, eps);
}

extern "C" __global__ void rms_norm_bf16(float* x, const float* add, const float* weight,
                                         bf16_t* out, int d, float eps) {
    grid_dependency_wait();
    rms_norm<bf16_t>(x, add, weight, out, d, eps);
}
