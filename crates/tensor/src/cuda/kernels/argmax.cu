// out[r] = the index of the largest value of row r (greedy sampling on the device), one block
// per row. Ties go to the lowest index and NaN is never chosen, as cpu::argmax does; a row of
// only NaN gives 0.
//
// With `feed` (one row), the pick also becomes the next decode step's input: feed holds a
// pass's [pos0, end, token...] as the kernels read them, and becomes [end, end + 1, pick],
// so the next one-token pass can be launched before the pick reaches the host.

#define ARGMAX_THREADS 1024

__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax(const float* __restrict__ logits, unsigned* __restrict__ out, int n, int* __restrict__ feed) {
    grid_dependency_wait();
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* row = logits + (size_t)blockIdx.x * n;
    float v = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float x = row[i];
        // False for NaN; indices rise, so the first of equal values stays. The second test
        // takes a first -inf, as the CPU's rule does (the largest non-NaN value).
        if (x > v || (x == v && idx == 0x7fffffff)) {
            v = x;
            idx = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        better(v, idx, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, idx, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        v = lane < warps ? best_v[lane] : NEG_INF;
        idx = lane < warps ? best_i[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            better(v, idx, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, idx, o));
        if (lane == 0) {
            const unsigned pick = idx == 0x7fffffff ? 0u : (unsigned)idx;
            out[blockIdx.x] = pick;
            if (feed) {
                feed[0] = feed[1];
                feed[1] += 1;
                feed[2] = (int)pick;
            }
        }
    }
}
