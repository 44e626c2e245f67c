// Flash-decoding: one new token's queries (f32, [n_heads, d]) over the first `context`
// positions of one layer's KV cache (f32, bf16 or f16, rows of [n_kv_heads, d] in the
// sequence's blocks, KvPages in common.cuh); query
// head h reads kv head h / (n_heads / n_kv_heads). Every product here is f32 (CUDA cores);
// attention_decode_mma.cu, which follows this file in its module, does them on the tensor
// cores for 16-bit caches and shares the chunking, rope and merge below.
//
// The keys are split into chunks, a block per (chunk, kv head, ROWS query heads of its
// group), so each key is read once for ROWS heads. Decode is a stream over the cache, so the
// keys go from memory straight into registers, never through shared memory: a lane holds E
// consecutive values of every key and value row it reads (lane l values l·E .. l·E + E), a
// warp takes KB keys at a time, all their loads issued at once. Each lane multiplies its
// slice of the KB keys with its slice of the ROWS queries, and one reduce-scatter across the
// warp (KB·ROWS ≤ 32 sums, halved at each of the 5 shuffle levels) leaves every lane with
// one whole score. The running (max, sum, weighted values) of each row are rescaled once per
// KB keys (online softmax), the values weighted by scores shuffled from their lanes.
//
// The warps of a block then merge in shared memory. A context of one chunk is written out
// finished; otherwise each block writes its unnormalised partial result, and the last block
// of a (kv head, rows) to finish (an atomic ticket) merges every chunk in chunk order, so the
// bits do not depend on which block ends last, and resets the ticket for the next launch.
//
// The chunks depend on the context alone (and the device: `target_splits`), never on the
// grid: a launch over many sequences' rows (DecodeBatch) has fewer blocks a row than chunks,
// and a block then takes chunks blockIdx.x, + gridDim.x, ... in turn, each exactly as a block
// of its own would, so a row's bits are the same in a batch of any size.
//
// The context may be read from device memory (a recorded graph's step), so the chunking is
// worked out on the device from it alone: the grid may have more chunks than there are, and
// those blocks leave at once.
//
// Before waiting on the kernel before (the q/k/v projections, launched to overlap it), a
// block asks L2 for its first cached rows and loads the rope's tables: neither is written by
// that kernel, so their latency hides in its tail, and after the wait only the step's own
// queries and key remain to fetch.
//
// The `_rope` entry points (`DecodeRope` set) take the step's queries, key and value as the
// projections made them, and do what rope.cu and kv_store would have done before them: each block
// RMS-normalises (Qwen3's q/k norms) and rotates its query rows; the blocks of the last
// chunk do the same for the new key (position context - 1) and use it, rounded to the
// cache's type as a stored key would be, in place of the cache's row; the first of them for
// each kv head stores the key and value there. So a decode step has no launch of its own for
// either, and the result is what the cache would have given.

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_MAX_SPLITS 64
#define DEC_MIN_KEYS_PER_SPLIT 128
#define DEC_KEY_ROUND 32
// Blocks per multiprocessor the host sizes the chunks for (attention.rs): about what the
// registers let one hold. Not imposed on the compiler: capped to fit three, the instances
// spilled and ran slower (qwen3-0.6b decode 776-830 tok/s against 849-861 uncapped on the
// H200), while two resident and a wave and a half measured the same or better.
#define DEC_BLOCKS_PER_SM 3

// Keys per chunk for a context: about `target_splits` chunks (the host sets it to fill the
// device), at least DEC_MIN_KEYS_PER_SPLIT, at most DEC_MAX_SPLITS chunks, a whole number of
// DEC_KEY_ROUND. The least was 32 (one batch of keys a warp: a lone short context spread over
// more blocks), but each chunk writes a partial of a quarter of what it reads and many rows
// at once (a batched step) are bound by that: 128 took 64 rows of 576 keys on qwen3-8b from
// 1.06 to 1.8 TB/s with the host's four waves (H100), and a lone 512-key step measured the
// same (bench batch, 177 tok/s either way).
__device__ __forceinline__ int decode_keys_per_split(int context, int target_splits) {
    int kps = max((context + target_splits - 1) / target_splits, DEC_MIN_KEYS_PER_SPLIT);
    kps = max(kps, (context + DEC_MAX_SPLITS - 1) / DEC_MAX_SPLITS);
    return (kps + DEC_KEY_ROUND - 1) / DEC_KEY_ROUND * DEC_KEY_ROUND;
}

// Values of 32-bit words, unpacked: one f32 or two 16-bit floats each.
template <typename KV> struct Words;
template <> struct Words<float> {
    static const int PER = 1;
    static __device__ __forceinline__ void unpack(unsigned w, float* f) { f[0] = __uint_as_float(w); }
};
template <> struct Words<bf16_t> {
    static const int PER = 2;
    static __device__ __forceinline__ void unpack(unsigned w, float* f) {
        f[0] = __uint_as_float(w << 16);
        f[1] = __uint_as_float(w & 0xffff0000u);
    }
};
template <> struct Words<f16_t> {
    static const int PER = 2;
    static __device__ __forceinline__ void unpack(unsigned w, float* f) {
        f16_t lo, hi;
        lo.bits = (unsigned short)(w & 0xffffu);
        hi.bits = (unsigned short)(w >> 16);
        f[0] = to_f32(lo);
        f[1] = to_f32(hi);
    }
};

// This lane's E values of a row of d (values lane·E ..), zero past d. With `vec` (set by the
// host: d a multiple of E and of 16 bytes, the cache on 16 bytes) a lane's values are whole,
// or all past d, and aligned to their size, so they come in one to four vector loads.
template <typename KV, int E>
__device__ __forceinline__ void load_lane(const KV* __restrict__ row, int lane, int d, int vec,
                                          float* out) {
    const int e0 = lane * E;
    if (vec) {
        if (e0 >= d) {
#pragma unroll
            for (int j = 0; j < E; ++j) out[j] = 0.0f;
            return;
        }
        const int WORDS = E / Words<KV>::PER;
        unsigned w[WORDS];
        const KV* p = row + e0;
        if constexpr (WORDS % 4 == 0) {
#pragma unroll
            for (int i = 0; i < WORDS; i += 4) {
                const uint4 v = ((const uint4*)p)[i / 4];
                w[i] = v.x;
                w[i + 1] = v.y;
                w[i + 2] = v.z;
                w[i + 3] = v.w;
            }
        } else if constexpr (WORDS == 2) {
            const uint2 v = *(const uint2*)p;
            w[0] = v.x;
            w[1] = v.y;
        } else {
            w[0] = *(const unsigned*)p;
        }
#pragma unroll
        for (int i = 0; i < WORDS; ++i) Words<KV>::unpack(w[i], out + i * Words<KV>::PER);
        return;
    }
#pragma unroll
    for (int j = 0; j < E; ++j) out[j] = e0 + j < d ? to_f32(row[e0 + j]) : 0.0f;
}

// One level of a reduce-scatter of 2·HALF sums across the warp, then the next: at offset o a
// lane keeps the half of its sums its bit o picks and adds its partner's copy of that half.
// After the level of offset 32 / SCORES, lane l holds sum l >> (5 - log2 SCORES), over the
// SCORES lanes that differ in the bits above. (A template per level, so every loop has a
// constant trip count and `s` stays in registers.)
template <int HALF>
__device__ __forceinline__ void reduce_scatter(float* s, int lane, int o) {
    const bool upper = lane & o;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float send = upper ? s[i] : s[i + HALF];
        const float keep = upper ? s[i + HALF] : s[i];
        s[i] = keep + __shfl_xor_sync(FULL_MASK, send, o);
    }
    if constexpr (HALF > 1) reduce_scatter<HALF / 2>(s, lane, o / 2);
}

// What the `_rope` entry points need to normalise, rotate and store the step's key themselves
// (the plain ones take it all zero and read none of it). Mirrors `RopeArgs` in attention.rs
// field for field.
struct DecodeRope {
    const float* k_new;   // [n_kv_heads, d]: the step's keys as projected
    const float* v_new;   // [n_kv_heads, d]
    const float* q_norm;  // [d] or null
    const float* k_norm;  // [d] or null
    const float* cos;     // [positions, d / 2]
    const float* sin;
    int positions;  // of the tables; a position past them is left unrotated, as rope.cu does
    int pairs;      // 1: rotate 2i with 2i + 1 (GGUF); 0: i with i + d/2 (HF)
    float eps;
};
static_assert(sizeof(DecodeRope) == 64, "RopeArgs in attention.rs has 64 bytes");

// What this lane needs to normalise and rotate its E values (lane·E ..) of a head to position
// `pos`: the norms' weights and the tables' cos and sin at its values. Constants, so they are
// loaded before the kernel waits on the one before it.
template <int E> struct LaneRope {
    float q_norm[E], k_norm[E];
    float cos[E], sin[E];  // for value j's pair
    bool rotate;           // a position past the tables is left unrotated, as rope.cu does
};

template <int E>
__device__ __forceinline__ LaneRope<E> lane_rope(const DecodeRope& r, int lane, int d, int pos) {
    LaneRope<E> lr;
    const int e0 = lane * E, half = d / 2;
    lr.rotate = pos < r.positions;
    const float* c = r.cos + (size_t)pos * half;
    const float* s = r.sin + (size_t)pos * half;
#pragma unroll
    for (int j = 0; j < E; ++j) {
        const int e = e0 + j;
        const bool in = e < d;
        lr.q_norm[j] = in && r.q_norm ? r.q_norm[e] : 1.0f;
        lr.k_norm[j] = in && r.k_norm ? r.k_norm[e] : 1.0f;
        // GGUF pairs rotate 2i with 2i + 1; HF halves i with i + d/2.
        const int i = r.pairs ? e / 2 : (e < half ? e : e - half);
        lr.cos[j] = in && lr.rotate ? c[i] : 1.0f;
        lr.sin[j] = in && lr.rotate ? s[i] : 0.0f;
    }
    return lr;
}

// This lane's E values of a head, RMS-normalised by `norm` (when `has_norm`) and rotated by
// `lr`, in place: rope.cu's arithmetic step for step (its sum of squares in this order, its
// products contracted as here), so a prompt row rotated there has the bits of a decode row. Needs the halves to start on a lane's first value (d / 2 a multiple of E, checked
// by the host); every lane of the warp takes part.
template <int E>
__device__ __forceinline__ void norm_rotate(float* x, const LaneRope<E>& lr, const float* norm,
                                            bool has_norm, bool pairs, float eps, int lane,
                                            int d) {
    const int e0 = lane * E;
    if (has_norm) {
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) ss = fmaf(x[j], x[j], ss);
        const float scale = 1.0f / sqrtf(warp_sum(ss) / (float)d + eps);
#pragma unroll
        for (int j = 0; j < E; ++j)
            if (e0 + j < d) x[j] = norm[j] * (x[j] * scale);
    }
    if (!lr.rotate) return;  // uniform across the warp
    if (pairs) {
#pragma unroll
        for (int j = 0; j < E; j += 2) {
            if (e0 + j >= d) break;
            const float x1 = x[j], x2 = x[j + 1];
            x[j] = fmaf(x1, lr.cos[j], -(x2 * lr.sin[j]));
            x[j + 1] = fmaf(x2, lr.cos[j], x1 * lr.sin[j]);
        }
        return;
    }
    // Element e pairs with e ± d/2, which is in lane ± d/(2E), at the same j.
    const int half = d / 2;
    const int lanes = half / E;
    const bool low = e0 < half;
    const int partner = low ? lane + lanes : lane - lanes;
#pragma unroll
    for (int j = 0; j < E; ++j) {
        const float other = __shfl_sync(FULL_MASK, x[j], partner & 31);
        if (e0 + j >= d) continue;
        x[j] = low ? fmaf(x[j], lr.cos[j], -(other * lr.sin[j]))
                   : fmaf(x[j], lr.cos[j], other * lr.sin[j]);
    }
}

// One value of a chunk's result, once the block's warps have put their rows' running maximum,
// sum and unnormalised values in shared memory (a warp that saw no key: maximum -inf, all
// zero): value e of row r merged over the warps, with the row's maximum and sum. Shared by
// the decode kernels and the prompt rows' (attention_prompt_rows.cu), so a row's bits are
// one arithmetic's.
template <int ROWS, int DMAX>
__device__ __forceinline__ float chunk_value(const float (*warp_m)[ROWS],
                                             const float (*warp_l)[ROWS],
                                             const float (*warp_acc)[ROWS][DMAX], int r, int e,
                                             float& mm, float& sum) {
    mm = NEG_INF;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) mm = fmaxf(mm, warp_m[w][r]);
    sum = 0.0f;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) {
        const float f = __expf(warp_m[w][r] - mm);  // 0 for a warp that saw no key
        sum = fmaf(f, warp_l[w][r], sum);
        o = fmaf(f, warp_acc[w][r][e], o);
    }
    return o;
}

// The end of a chunk's work: merges the warps (chunk_value), then writes the output (a
// context of one chunk) or the chunk's partial result. Shared by both decode kernels.
template <int ROWS, int DMAX>
__device__ __forceinline__ void decode_chunk_done(
    const float (*warp_m)[ROWS], const float (*warp_l)[ROWS], const float (*warp_acc)[ROWS][DMAX],
    int rows, int d, int head0, int split, int splits, int n_heads, float* __restrict__ part_ml,
    float* __restrict__ part_acc, float* __restrict__ out) {
    const bool alone = splits == 1;
    for (int i = threadIdx.x; i < rows * d; i += DEC_THREADS) {
        const int r = i / d, e = i - r * d;
        float mm, sum;
        const float o = chunk_value<ROWS, DMAX>(warp_m, warp_l, warp_acc, r, e, mm, sum);
        const size_t h = head0 + r;
        if (alone) {
            out[h * d + e] = o / sum;
            continue;
        }
        const size_t part = (size_t)split * n_heads + h;
        part_acc[part * d + e] = o;
        if (e == 0) {
            part_ml[2 * part] = mm;
            part_ml[2 * part + 1] = sum;
        }
    }
}

// Every chunk's partial result of `rows` heads from head0 merged in chunk order into `out`:
// each chunk weighted by e^(m_s - M) / sum_s e^(m_s - M) l_s. Every thread of the block takes
// part. Shared by the decode kernels (decode_merge) and the prompt rows' merge kernel.
template <int ROWS>
__device__ __forceinline__ void merge_chunks(int rows, int d, int head0, int splits, int n_heads,
                                             const float* __restrict__ part_ml,
                                             const float* __restrict__ part_acc,
                                             float* __restrict__ out) {
    __shared__ float merge_w[DEC_MAX_SPLITS][ROWS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Each chunk's weight for each row: a warp a row, a lane a chunk (two with 64).
    const int PER_LANE = DEC_MAX_SPLITS / 32;
    for (int r = warp; r < rows; r += DEC_WARPS) {
        const size_t h = head0 + r;
        float ms[PER_LANE], ls[PER_LANE], mm = NEG_INF;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            const int sp = lane + 32 * j;
            const size_t p = (size_t)sp * n_heads + h;
            ms[j] = sp < splits ? __ldcg(part_ml + 2 * p) : NEG_INF;
            ls[j] = sp < splits ? __ldcg(part_ml + 2 * p + 1) : 0.0f;
            mm = fmaxf(mm, ms[j]);
        }
        mm = warp_max(mm);
        float f[PER_LANE], sum = 0.0f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            f[j] = __expf(ms[j] - mm);  // 0 past the last chunk
            sum = fmaf(f[j], ls[j], sum);
        }
        const float inv = 1.0f / warp_sum(sum);
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j)
            if (lane + 32 * j < splits) merge_w[lane + 32 * j][r] = f[j] * inv;
    }
    __syncthreads();
    // The weighted sum of the chunks' values, four a thread in one 16-byte load a chunk where
    // d allows (the scratch is on 16 bytes), all of a thread's loads in flight at once.
    if (d % 4 == 0) {
        for (int i = 4 * threadIdx.x; i < rows * d; i += 4 * DEC_THREADS) {
            const int r = i / d, e = i - r * d;
            const size_t h = head0 + r;
            float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16
            for (int sp = 0; sp < splits; ++sp) {
                const float4 v = __ldcg((const float4*)(part_acc + ((size_t)sp * n_heads + h) * d + e));
                const float w = merge_w[sp][r];
                o.x = fmaf(w, v.x, o.x);
                o.y = fmaf(w, v.y, o.y);
                o.z = fmaf(w, v.z, o.z);
                o.w = fmaf(w, v.w, o.w);
            }
            float* dst = out + h * d + e;
            dst[0] = o.x;
            dst[1] = o.y;
            dst[2] = o.z;
            dst[3] = o.w;
        }
    } else {
        for (int i = threadIdx.x; i < rows * d; i += DEC_THREADS) {
            const int r = i / d, e = i - r * d;
            const size_t h = head0 + r;
            float o = 0.0f;
#pragma unroll 16
            for (int sp = 0; sp < splits; ++sp)
                o = fmaf(merge_w[sp][r], __ldcg(part_acc + ((size_t)sp * n_heads + h) * d + e), o);
            out[h * d + e] = o;
        }
    }
}

// After a block's chunks (`done` of them) are written: the last block of a (kv head, rows) to
// finish (an atomic ticket counting chunks) merges every chunk in chunk order (merge_chunks),
// so the bits do not depend on which block ends last or on how many chunks each block took,
// and resets the ticket for the next launch. Shared by both decode kernels.
template <int ROWS>
__device__ __forceinline__ void decode_merge(int rows, int d, int head0, int splits, int done,
                                             int n_heads, const float* __restrict__ part_ml,
                                             const float* __restrict__ part_acc,
                                             unsigned* __restrict__ tickets,
                                             float* __restrict__ out) {
    __shared__ bool last;
    if (splits == 1 || done == 0) return;
    __threadfence();  // this block's partials are visible before its ticket is
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(&tickets[blockIdx.y], (unsigned)done) + (unsigned)done == (unsigned)splits;
    __syncthreads();
    if (!last) return;
    __threadfence();
    merge_chunks<ROWS>(rows, d, head0, splits, n_heads, part_ml, part_acc, out);
    if (threadIdx.x == 0) tickets[blockIdx.y] = 0;
}

// grid: (chunks or fewer, n_kv_heads · ceil(group / ROWS), rows of a DecodeBatch). Scratch
// (each row's): part_ml [chunks, n_heads, 2],
// part_acc [chunks, n_heads, d], tickets [gridDim.y] (zero before the first launch; left zero).
// FUSED: `rope` is set (the `_rope` entry points); known when compiling, so the plain form's
// key loop holds nothing of it.
//
// `wait` is the entry point's grid_dependency_wait(), called once what does not depend on the
// kernel before has been asked for.
template <typename KV, int E, int ROWS, bool FUSED, typename Wait>
__device__ __forceinline__ void attention_decode(
    const float* __restrict__ q, KV* __restrict__ kc, KV* __restrict__ vc,
    float* __restrict__ part_ml, float* __restrict__ part_acc, unsigned* __restrict__ tickets,
    float* __restrict__ out, int context, const int* __restrict__ context_dev, int n_heads,
    int n_kv_heads, int d, float scale, int target_splits, int vec, const KvPages& pages,
    const DecodeRope& rope, Wait wait) {
    // Keys a warp takes at once: its KB·ROWS scores fit the 32 lanes.
    const int KB = ROWS >= 8 ? 32 / ROWS : 8;
    const int SCORES = KB * ROWS;  // 8, 16 or 32
    const int LEVELS = SCORES == 32 ? 5 : (SCORES == 16 ? 4 : 3);  // log2(SCORES)
    // After the reduce-scatter lane l holds score l >> SHIFT (2^SHIFT lanes hold each).
    const int SHIFT = 5 - LEVELS;

    // The context comes from the step's inputs, copied in before the pass's first kernel.
    if (context_dev) context = *context_dev;
    const int keys_per_split = decode_keys_per_split(context, target_splits);
    const int splits = (context + keys_per_split - 1) / keys_per_split;
    if ((int)blockIdx.x >= splits) return;  // a chunk past the context
    const int group = n_heads / n_kv_heads;
    const int row_blocks = (group + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / row_blocks;
    const int head0 = kvh * group + (blockIdx.y % row_blocks) * ROWS;  // this block's first
    const int rows = min(ROWS, kvh * group + group - head0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // The end of the chunk in hand: the block takes chunks blockIdx.x, + gridDim.x, ...
    int t_end = min(context, ((int)blockIdx.x + 1) * keys_per_split);
    const int stride = n_kv_heads * d;
    const KV* kh = kc + (size_t)kvh * d;
    const KV* vh = vc + (size_t)kvh * d;
    const int pos = context - 1;  // the step's own position
    // The last position read from the cache: the new one is not there yet when fused.
    const int last_cached = FUSED ? pos - 1 : pos;

    // A batch's keys and values, asked of L2 (a lane a row) some batches before they are read,
    // so that a warp's loads, issued all at once and then waited for, mostly hit the cache.
    auto prefetch = [&](int t0) {
        const int t = t0 + (lane >> 1);
        if (vec && lane < 2 * KB && t < t_end && t <= last_cached)
            prefetch_l2_lines(((lane & 1) ? vh : kh) + kv_row(pages, t, stride), d * sizeof(KV));
    };
    const int step = DEC_WARPS * KB;
    int first = blockIdx.x * keys_per_split + warp * KB;
    // Before waiting on the kernel before (the projections): the cached rows and the rope's
    // tables, which it does not write (the cache's rows were written by earlier steps' kernels,
    // done before it began), so their latency overlaps its tail.
    prefetch(first);
    prefetch(first + step);
    LaneRope<E> lr;
    if (FUSED) lr = lane_rope<E>(rope, lane, d, pos);
    wait();

    float qv[ROWS][E];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const int e = lane * E + j;
            qv[r][j] = (r < rows && e < d) ? q[(size_t)(head0 + r) * d + e] : 0.0f;
        }
    }
    // The new key and value, where one of this block's chunks (the last) holds them: as the
    // cache will hold them.
    const bool holds_new = FUSED && (splits - 1) % (int)gridDim.x == (int)blockIdx.x;
    float k_new[E], v_new[E];
    if (holds_new) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const int e = lane * E + j;
            k_new[j] = e < d ? rope.k_new[(size_t)kvh * d + e] : 0.0f;
            v_new[j] = e < d ? rope.v_new[(size_t)kvh * d + e] : 0.0f;
        }
    }
    if (FUSED) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (r < rows)
                norm_rotate<E>(qv[r], lr, lr.q_norm, rope.q_norm != nullptr, rope.pairs, rope.eps, lane, d);
    }
    if (holds_new) {
        norm_rotate<E>(k_new, lr, lr.k_norm, rope.k_norm != nullptr, rope.pairs, rope.eps, lane, d);
        const bool stores = blockIdx.y % row_blocks == 0 && warp == 0 && pos < pages.capacity;
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const int e = lane * E + j;
            const KV kq = from_f32<KV>(k_new[j]), vq = from_f32<KV>(v_new[j]);
            if (stores && e < d) {
                kc[kv_row(pages, pos, stride) + (size_t)kvh * d + e] = kq;
                vc[kv_row(pages, pos, stride) + (size_t)kvh * d + e] = vq;
            }
            k_new[j] = to_f32(kq);
            v_new[j] = to_f32(vq);
        }
    }

    // This lane's score is of key `my_key` of the batch for row `my_row`; `owner`: the one
    // lane of the 2^SHIFT holding it that counts it in the row's sum.
    const int my_score = lane >> SHIFT, my_row = my_score / KB, my_key = my_score % KB;
    const bool owner = (lane & ((1 << SHIFT) - 1)) == 0;
    // Each chunk as a block of its own would take it (so a row's bits do not depend on how
    // many chunks a block takes: a launch over many rows gives each block several).
    int done = 0;
    for (int split = blockIdx.x; split < splits; split += gridDim.x, ++done) {
        t_end = min(context, (split + 1) * keys_per_split);
        first = split * keys_per_split + warp * KB;
        const bool has_new = holds_new && t_end == context;
        if (done > 0) {
            prefetch(first);
            prefetch(first + step);
        }
        float m[ROWS], acc[ROWS][E];
        float l = 0.0f;  // the owned scores' share of row my_row's sum
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            m[r] = NEG_INF;
#pragma unroll
            for (int j = 0; j < E; ++j) acc[r][j] = 0.0f;
        }

        for (int t0 = first; t0 < t_end; t0 += step) {
            prefetch(t0 + 2 * step);
            float kf[KB][E], vf[KB][E];
#pragma unroll
            for (int k = 0; k < KB; ++k) {
                // Keys past the chunk re-read its last cached one; their scores are masked below.
                const int tl = min(min(t0 + k, t_end - 1), last_cached);
                if (!FUSED || tl >= 0) {  // (the plain form always has a cached key)
                    load_lane<KV, E>(kh + kv_row(pages, tl, stride), lane, d, vec, kf[k]);
                    load_lane<KV, E>(vh + kv_row(pages, tl, stride), lane, d, vec, vf[k]);
                } else {
                    // Nothing cached yet (the step is at position 0): finite values, which a
                    // masked key's zero weight then cancels.
#pragma unroll
                    for (int j = 0; j < E; ++j) kf[k][j] = vf[k][j] = 0.0f;
                }
                if (has_new && t0 + k == pos) {
#pragma unroll
                    for (int j = 0; j < E; ++j) {
                        kf[k][j] = k_new[j];
                        vf[k][j] = v_new[j];
                    }
                }
            }
            float s[SCORES];
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int k = 0; k < KB; ++k) {
                    float dot = 0.0f;
#pragma unroll
                    for (int j = 0; j < E; ++j) dot = fmaf(qv[r][j], kf[k][j], dot);
                    s[r * KB + k] = dot;
                }
            reduce_scatter<SCORES / 2>(s, lane, 16);
#pragma unroll
            for (int level = LEVELS; level < 5; ++level) s[0] += __shfl_xor_sync(FULL_MASK, s[0], 16 >> level);
            const float score = t0 + my_key < t_end ? s[0] * scale : NEG_INF;

            // Each row's maximum over the batch: across the lanes of its keys.
            float batch_max = score;
#pragma unroll
            for (int o = 1 << SHIFT; o < (KB << SHIFT); o *= 2)
                batch_max = fmaxf(batch_max, __shfl_xor_sync(FULL_MASK, batch_max, o));
            float correction[ROWS], mine_m = 0.0f, mine_correction = 0.0f;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                // Every batch holds a key of the chunk, so the new maximum is finite.
                const float mr = fmaxf(m[r], __shfl_sync(FULL_MASK, batch_max, (r * KB) << SHIFT));
                correction[r] = __expf(m[r] - mr);  // 0 on the first batch (m = -inf)
                m[r] = mr;
                if (r == my_row) {
                    mine_m = mr;
                    mine_correction = correction[r];
                }
            }
            const float p = __expf(score - mine_m);  // 0 for a masked key
            l = l * mine_correction + (owner ? p : 0.0f);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
#pragma unroll
                for (int j = 0; j < E; ++j) acc[r][j] *= correction[r];
#pragma unroll
                for (int k = 0; k < KB; ++k) {
                    const float pk = __shfl_sync(FULL_MASK, p, (r * KB + k) << SHIFT);
#pragma unroll
                    for (int j = 0; j < E; ++j) acc[r][j] = fmaf(pk, vf[k][j], acc[r][j]);
                }
            }
        }

        // Each warp's rows to shared memory, for the block's merge.
        __shared__ float warp_m[DEC_WARPS][ROWS], warp_l[DEC_WARPS][ROWS];
        __shared__ float warp_acc[DEC_WARPS][ROWS][E * 32];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float lr = warp_sum(r == my_row ? l : 0.0f);
            if (lane == 0) {
                warp_m[warp][r] = m[r];
                warp_l[warp][r] = lr;
            }
#pragma unroll
            for (int j = 0; j < E; ++j) warp_acc[warp][r][lane * E + j] = acc[r][j];
        }
        __syncthreads();
        decode_chunk_done<ROWS, E * 32>(warp_m, warp_l, warp_acc, rows, d, head0, split, splits,
                                        n_heads, part_ml, part_acc, out);
        __syncthreads();  // the shared rows are the next chunk's
    }
    decode_merge<ROWS>(rows, d, head0, splits, done, n_heads, part_ml, part_acc, tickets, out);
}

// A launch over the decode rows of several sequences, one a grid z: z's query is pass row
// `rows[z]`, at position `row_pos[row]` (so its context is that + 1), of sequence
// `row_seq[row]`, whose block table starts `row_seq · table_stride` entries after
// `pages.table`; z's scratch starts `z · scratch_stride` values after the first. `rows` null:
// one sequence, as the other arguments say. A row's chunks are its context's alone, as in a
// launch of its own, so its bits do not depend on the rows beside it. Mirrors `DecodeBatch`
// in attention.rs field for field.
struct DecodeBatch {
    const int* rows;
    const int* row_pos;
    const int* row_seq;
    long long table_stride;
    long long scratch_stride;
};
static_assert(sizeof(DecodeBatch) == 40, "DecodeBatch in attention.rs has 40 bytes");

// Points a batched launch's arguments at grid z's row, sequence and scratch (the pass inputs
// are written before the pass, so they are read before the kernel waits).
__device__ __forceinline__ void decode_batch_row(const DecodeBatch& b, int n_heads, int n_kv_heads,
                                                 int d, const float*& q, float*& out,
                                                 float*& part_ml, float*& part_acc,
                                                 unsigned*& tickets, int& context,
                                                 const int*& context_dev, KvPages& pages,
                                                 DecodeRope& rope) {
    if (!b.rows) return;
    const int z = blockIdx.z;
    const int row = b.rows[z];
    context = b.row_pos[row] + 1;
    context_dev = nullptr;
    pages.table += (size_t)b.row_seq[row] * b.table_stride;
    q += (size_t)row * n_heads * d;
    out += (size_t)row * n_heads * d;
    if (rope.k_new) {
        rope.k_new += (size_t)row * n_kv_heads * d;
        rope.v_new += (size_t)row * n_kv_heads * d;
    }
    const size_t scratch = (size_t)z * b.scratch_stride;
    part_ml += scratch;
    part_acc += scratch;
    tickets += scratch;
}

#define ATTENTION_DECODE_ENTRY(NAME, KV, E, ROWS, FUSED)                                      \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) NAME(                           \
        const float* q, KV* kc, KV* vc, float* part_ml, float* part_acc, unsigned* tickets,     \
        float* out, int context, const int* context_dev, int n_heads, int n_kv_heads, int d,    \
        float scale, int target_splits, int vec, KvPages pages, DecodeRope rope,                \
        const DecodeBatch batch) {                                                              \
        decode_batch_row(batch, n_heads, n_kv_heads, d, q, out, part_ml, part_acc, tickets,     \
                         context, context_dev, pages, rope);                                    \
        attention_decode<KV, E, ROWS, FUSED>(q, kc, vc, part_ml, part_acc, tickets, out,        \
                                             context, context_dev, n_heads, n_kv_heads, d,      \
                                             scale, target_splits, vec, pages, rope,            \
                                             [] { grid_dependency_wait(); });                   \
    }
#define ATTENTION_DECODE(T, KV, E, ROWS)                                                        \
    ATTENTION_DECODE_ENTRY(attention_decode_##T##_e##E##_r##ROWS, KV, E, ROWS, false)           \
    ATTENTION_DECODE_ENTRY(attention_decode_rope_##T##_e##E##_r##ROWS, KV, E, ROWS, true)
#define ATTENTION_DECODE_ALL_ROWS(T, KV, E)                                                     \
    ATTENTION_DECODE(T, KV, E, 1)                                                               \
    ATTENTION_DECODE(T, KV, E, 2)                                                               \
    ATTENTION_DECODE(T, KV, E, 4)                                                               \
    ATTENTION_DECODE(T, KV, E, 8)
#define ATTENTION_DECODE_ALL(T, KV)                                                             \
    ATTENTION_DECODE_ALL_ROWS(T, KV, 2)                                                         \
    ATTENTION_DECODE_ALL_ROWS(T, KV, 4)                                                         \
    ATTENTION_DECODE_ALL_ROWS(T, KV, 8)

// Instantiated per cache type by the module that includes this file (kernels.rs appends
// `ATTENTION_DECODE_ALL(bf16, bf16_t)` or the like): a module a type, compiled side by side.
