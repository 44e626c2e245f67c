// out[r] = x[r] / rms(x[r]) * weight, one block per row of d values.
//
// With `add` set the residual add is fused in front: x[r] += add[r] is written back, then
// normalised, which is the pre-norm pattern `x = x + f(x); h = norm(x)` in one pass. `out`
// may be f32 (decode) or bf16 (the input of a prefill GEMM) and may alias x.
//
// A row whose d is a multiple of 4 and at most RMS_GROUPS·4 values a thread (the host sizes
// the block so: rms_norm.rs) is held in registers: each thread loads its groups of four at
// once, so the row costs one memory round trip rather than one per value a thread (a decode
// step's norms of 64 rows of 4096 took 7.4 us each as a loop, mostly waiting). Other rows
// take the loop. Either way a row's arithmetic depends on d alone, not on how many rows a
// launch takes nor on where they lie (unaligned groups load as scalars, added in the same
// order).

#define RMS_GROUPS 4

__device__ __forceinline__ float4 load_group(const float* p) {
    if (((size_t)p & 15) == 0) return *(const float4*)p;
    return make_float4(p[0], p[1], p[2], p[3]);
}

__device__ __forceinline__ void store_group(float* p, float4 v) {
    if (((size_t)p & 15) == 0) {
        *(float4*)p = v;
    } else {
        p[0] = v.x; p[1] = v.y; p[2] = v.z; p[3] = v.w;
    }
}

__device__ __forceinline__ void store_group(bf16_t* p, float4 v) {
    const bf16_t a = from_f32<bf16_t>(v.x), b = from_f32<bf16_t>(v.y),
                 c = from_f32<bf16_t>(v.z), e = from_f32<bf16_t>(v.w);
    if (((size_t)p & 7) == 0) {
        *(uint2*)p = make_uint2((unsigned)a.bits | ((unsigned)b.bits << 16),
                                (unsigned)c.bits | ((unsigned)e.bits << 16));
    } else {
        p[0] = a; p[1] = b; p[2] = c; p[3] = e;
    }
}

template <typename O>
__device__ __forceinline__ void rms_norm_held(float* x, const float* __restrict__ add,
                                              const float* __restrict__ weight, O* out, int d,
                                              float eps) {
    float* xr = x + (size_t)blockIdx.x * d;
    const float* ar = add ? add + (size_t)blockIdx.x * d : nullptr;
    O* outr = out + (size_t)blockIdx.x * d;
    float4 v[RMS_GROUPS];
#pragma unroll
    for (int k = 0; k < RMS_GROUPS; ++k) {
        const int i = (k * blockDim.x + threadIdx.x) * 4;
        if (i < d) {
            v[k] = load_group(xr + i);
            if (ar) {
                const float4 a = load_group(ar + i);
                v[k].x += a.x; v[k].y += a.y; v[k].z += a.z; v[k].w += a.w;
            }
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_GROUPS; ++k) {
        const int i = (k * blockDim.x + threadIdx.x) * 4;
        if (i < d) {
            if (ar) store_group(xr + i, v[k]);
            ss = fmaf(v[k].x, v[k].x, ss);
            ss = fmaf(v[k].y, v[k].y, ss);
            ss = fmaf(v[k].z, v[k].z, ss);
            ss = fmaf(v[k].w, v[k].w, ss);
        }
    }
    const float scale = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
#pragma unroll
    for (int k = 0; k < RMS_GROUPS; ++k) {
        const int i = (k * blockDim.x + threadIdx.x) * 4;
        if (i < d) {
            const float4 w = load_group(weight + i);
            store_group(outr + i, make_float4(w.x * (v[k].x * scale), w.y * (v[k].y * scale),
                                              w.z * (v[k].z * scale), w.w * (v[k].w * scale)));
        }
    }
}

template <typename O>
__device__ __forceinline__ void rms_norm_loop(float* x, const float* __restrict__ add,
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

template <typename O>
__device__ __forceinline__ void rms_norm(float* x, const float* __restrict__ add,
                                         const float* __restrict__ weight, O* out, int d,
                                         float eps) {
    if (d % 4 == 0 && d <= RMS_GROUPS * 4 * (int)blockDim.x) {
        rms_norm_held<O>(x, add, weight, out, d, eps);
    } else {
        rms_norm_loop<O>(x, add, weight, out, d, eps);
    }
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
