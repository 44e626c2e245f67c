// Prepended to every kernel source. NVRTC 13 ships no cuda_bf16.h / cuda_fp16.h, so 16-bit
// floats are raw bit patterns here, converted by shifts (bf16) or one PTX instruction (f16).

struct bf16_t {
    unsigned short bits;
};
struct f16_t {
    unsigned short bits;
};

// Programmatic dependent launch (compute capability 9.0 on): the host launches each kernel
// so that it may start while the one before it finishes (CudaDevice::launch_kernel). Every
// kernel calls grid_dependency_wait() before it reads or writes memory that the kernels before
// it write or read (weights, never written during a step, excepted), which waits until they
// have finished and their writes are visible, and then lets the next kernel's blocks be
// scheduled as its own finish. Elsewhere both are no-ops and launches are in stream order.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks L2 for `bytes` (a multiple of 16) from `p` (on 16 bytes) without waiting for them; a
// hint, so a no-op before compute capability 9.0, whose bulk prefetch it uses.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Asks L2 for the 128-byte lines that hold `bytes` from `p`, for this lane alone. The bulk form
// above takes a warp-uniform address: called by lanes with different rows, the compiler loops
// over the lanes one at a time (8 instructions each: a tenth of the batched decode attention's
// instructions), where this is one instruction a line.
__device__ __forceinline__ void prefetch_l2_lines(const void* p, unsigned bytes) {
    const size_t end = (size_t)p + bytes;
    for (size_t line = (size_t)p & ~(size_t)127; line < end; line += 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
}

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16_t x) { return __uint_as_float(((unsigned)x.bits) << 16); }
__device__ __forceinline__ float to_f32(f16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
// Round to nearest even, NaN kept quiet: what half::bf16::from_f32 does on the host.
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
    unsigned u = __float_as_uint(x);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = (unsigned short)(u >> 16);
    }
    return r;
}
template <> __device__ __forceinline__ f16_t from_f32<f16_t>(float x) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// SwiGLU's activation, x · sigmoid(x).
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `partial` may still be read by an earlier call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

// 16 bytes of weights, read once: skip L1 so the activations it holds stay there.
__device__ __forceinline__ uint4 load_stream16(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ float4 load_f4(const float* p) {
    float4 v;
    asm("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];"
        : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
        : "l"(p));
    return v;
}

// Unpacks 16 bytes of stored values into N floats.
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

// A sequence's blocks in the KV pool, as the attention kernels address one layer's cache:
// position t is row t & (2^shift - 1) of block table[t >> shift], and each block's rows start
// block_stride elements after the previous block's (every layer's keys and values of a block
// lie together). Mirrors `KvPages` in attention.rs field for field.
struct KvPages {
    const int* table;
    long long block_stride;
    int shift;
    int capacity;  // positions the table covers; a store past them is dropped
};
static_assert(sizeof(KvPages) == 24, "KvPages in attention.rs has 24 bytes");

// Elements from a layer's cache base to position t's row of `row_stride` elements.
__device__ __forceinline__ size_t kv_row(const KvPages& p, int t, int row_stride) {
    return (size_t)p.table[t >> p.shift] * (size_t)p.block_stride +
           (size_t)(t & ((1 << p.shift) - 1)) * (size_t)row_stride;
}

// Prompt attention split over the keys: each split's unnormalised result for every (row, head)
// of the chunk, `[split][row][head][d]`, then its running max and sum, `[split][row][head][2]`
// (attention_prefill_combine merges them; attention.rs sizes the scratch).
struct PrefillPart {
    float* base;
    int splits, n, n_heads, d;
    __device__ __forceinline__ PrefillPart(float* base, int splits, int n, int n_heads, int d)
        : base(base), splits(splits), n(n), n_heads(n_heads), d(d) {}
    __device__ __forceinline__ size_t at(int split, int row, int h) const {
        return ((size_t)split * n + row) * n_heads + h;
    }
    __device__ __forceinline__ float* acc(int split, int row, int h) const {
        return base + at(split, row, h) * d;
    }
    __device__ __forceinline__ float* ml(int split, int row, int h) const {
        return base + (size_t)splits * n * n_heads * d + at(split, row, h) * 2;
    }
};
