// out[r] = the index of the largest value of row r (greedy sampling on the device). Ties go to
// the lowest index and NaN is never chosen, as cpu::argmax does; a row of only NaN gives 0.
//
// A row is cut into gridDim.x contiguous chunks, a block each (a single block took 35 us over
// a 152k vocabulary on the H200, longer than a qwen3-0.6b layer). Each block writes its
// chunk's best (value, index) to scratch, and the last block of the row to finish (an atomic
// ticket) picks the best of those and resets the ticket. "Best" is the largest value, then the
// lowest index, a choice that does not depend on the order the chunks are compared in, so the
// pick never depends on which block ends last.
//
// With `feed` (one row), the pick also becomes the next decode step's input: feed holds a
// pass's [pos0, end, token...] as the kernels read them, and becomes [end, end + 1, pick],
// so the next one-token pass can be launched before the pick reaches the host.
//
// Scratch per row (u32 words, ARGMAX_ROW_WORDS): the chunks' best values (f32 bits), their
// indices, then the row's ticket (zero before the first launch; left zero).

#define ARGMAX_THREADS 256
#define ARGMAX_MAX_BLOCKS 128
#define ARGMAX_ROW_WORDS (2 * ARGMAX_MAX_BLOCKS + 1)
// Loads a thread has in flight at once: issued together, then compared in index order.
#define ARGMAX_BATCH 8
#define ARGMAX_NONE 0x7fffffff

__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// The block's best of every thread's (v, i), in thread 0.
__device__ __forceinline__ void block_best(float& v, int& i) {
    __shared__ float best_v[ARGMAX_THREADS / 32];
    __shared__ int best_i[ARGMAX_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        better(v, i, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, i, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < ARGMAX_THREADS / 32 ? best_v[lane] : NEG_INF;
        i = lane < ARGMAX_THREADS / 32 ? best_i[lane] : ARGMAX_NONE;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            better(v, i, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, i, o));
    }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax(const float* __restrict__ logits, unsigned* __restrict__ out, int n,
           int* __restrict__ feed, unsigned* __restrict__ scratch) {
    grid_dependency_wait();
    __shared__ bool last;
    const int chunks = gridDim.x, r = blockIdx.y;
    const float* row = logits + (size_t)r * n;
    const int chunk = (n + chunks - 1) / chunks;
    const int lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    float v = NEG_INF;
    int idx = ARGMAX_NONE;
    for (int base = lo + threadIdx.x; base < hi; base += ARGMAX_BATCH * ARGMAX_THREADS) {
        float x[ARGMAX_BATCH];
#pragma unroll
        for (int j = 0; j < ARGMAX_BATCH; ++j) {
            const int i = base + j * ARGMAX_THREADS;
            x[j] = i < hi ? row[i] : __int_as_float(0x7fffffff);  // NaN: never taken
        }
        // A thread's indices rise, so the first of equal values stays; NaN compares false.
        // The second test takes a first -inf, as the CPU's rule does (the largest non-NaN).
#pragma unroll
        for (int j = 0; j < ARGMAX_BATCH; ++j) {
            if (x[j] > v || (x[j] == v && idx == ARGMAX_NONE)) {
                v = x[j];
                idx = base + j * ARGMAX_THREADS;
            }
        }
    }
    block_best(v, idx);

    unsigned* s = scratch + (size_t)r * ARGMAX_ROW_WORDS;
    unsigned* ticket = s + 2 * ARGMAX_MAX_BLOCKS;
    if (chunks > 1) {
        if (threadIdx.x == 0) {
            s[blockIdx.x] = __float_as_uint(v);
            s[ARGMAX_MAX_BLOCKS + blockIdx.x] = (unsigned)idx;
            __threadfence();  // this chunk's best is visible before its ticket is
            last = atomicAdd(ticket, 1u) == (unsigned)chunks - 1;
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        // The chunks' bests, read past L1 (written by other multiprocessors).
        v = NEG_INF;
        idx = ARGMAX_NONE;
        for (int c = threadIdx.x; c < chunks; c += ARGMAX_THREADS)
            better(v, idx, __uint_as_float(__ldcg(s + c)), (int)__ldcg(s + ARGMAX_MAX_BLOCKS + c));
        block_best(v, idx);
    }
    if (threadIdx.x == 0) {
        const unsigned pick = idx == ARGMAX_NONE ? 0u : (unsigned)idx;
        out[r] = pick;
        if (feed) {
            feed[0] = feed[1];
            feed[1] += 1;
            feed[2] = (int)pick;
        }
        if (chunks > 1) *ticket = 0;
    }
}
