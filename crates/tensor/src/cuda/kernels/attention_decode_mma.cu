// Flash-decoding on the tensor cores (sm_80 and later), for 16-bit caches and heads of D = 64
// or 128 values: the chunks, grid, scratch, rope fusion and merge of attention_decode.cu
// (prepended to this file), with both products on mma.m16n8k16 and f32 sums.
//
// Why: the CUDA-core kernel spends about 450 instructions a lane on 8 keys (a reduce-scatter
// of the scores and a shuffle per probability), so past a few thousand keys it is bound by
// issue and latency, not by the cache's bytes. Here a warp takes 16 keys per step in 16 mma
// and a few dozen other instructions. H200, 32/8 heads of 128 over a bf16 cache (cuda_probe):
// 4096 keys 20.6 -> 13.5 µs, 32768 keys 89 -> 42 µs (1.5 -> 3.2 TB/s); up to 2048 keys both
// take 5.6-9.4 µs, the latency of the launch, the loads and the merge.
//
// A block takes up to 8 query heads of one kv head (the n of the mma); each warp takes 16 keys
// at a time (the m), for its own running maximum and sum, as in attention_decode.cu:
//   scores^T (16 keys × 8 heads) = K (16 × D) · q^T (D × 8),
//   out^T (D × 8 heads)         += V^T (D × 16 keys) · p^T (16 keys × 8).
// The order of a head's values inside a product is free as long as both operands agree, so
// each lane's operands come straight from memory in 16-byte loads, never through shared
// memory: in the first product lane (g, t) = (lane / 4, lane % 4) holds, of keys g and g + 8,
// values 8(4i + t) .. + 8 for each i < D / 32 (slices 2i and 2i + 1, columns 2t, 2t + 1,
// 2t + 8, 2t + 9 of each), and the queries' B fragments are packed from the same values. In
// the second it holds, of keys 2t, 2t + 1, 2t + 8 and 2t + 9, values 64p + 8g .. + 8 for each
// p < D / 64: word w of part p is the pair of rows (g, g + 8) of d tile 4p + w, and two
// keys' words are interleaved into an A register by a byte permute. The probabilities reach
// the B fragment of the second product from the accumulator of the first by one 8×8
// transpose (movmatrix) a half.
//
// Fused, the first step's cached rows are loaded before the kernel waits on the one before
// (earlier steps wrote them); the step's own row is patched in from shared memory after.
//
// Queries and probabilities are rounded to the cache's 16-bit type for the products, as
// transformers' 16-bit attention rounds them; the host takes this kernel only where the
// model's prefill already runs in 16 bits (AttentionPrecision::Bf16).

#define DEC_MMA_ROWS 8
#define DEC_MMA_KEYS 16

// A step's 16 keys (from a multiple of 16) lie in one block of the pool, whose blocks hold 16
// positions or more (the host takes this kernel only then): the table is read once a step, not
// once a row and 16-byte part.
__device__ __forceinline__ size_t step_block(const KvPages& p, int t0) {
    return (size_t)p.table[t0 >> p.shift] * (size_t)p.block_stride;
}
__device__ __forceinline__ size_t step_row(const KvPages& p, size_t block, int t, int row_stride) {
    return block + (size_t)(t & ((1 << p.shift) - 1)) * (size_t)row_stride;
}

__device__ __forceinline__ unsigned word_of(const uint4& v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// The queries' B fragments of the first product: this lane's of column g, whose D values
// are at `col` (a query row, in shared memory for the decode kernel, in global memory for the
// prompt rows'; zeros where `has` is false).
template <typename KV, int D>
__device__ __forceinline__ void mma_query_fragments(const float* col, bool has, int t,
                                                    unsigned (&qb)[D / 16][2]) {
    using Mma = Mma16<KV>;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
        const float4 a = has ? *(const float4*)&col[8 * (4 * i + t)] : zero;
        const float4 b = has ? *(const float4*)&col[8 * (4 * i + t) + 4] : zero;
        qb[2 * i][0] = Mma::pack(a.x, a.y);
        qb[2 * i][1] = Mma::pack(a.z, a.w);
        qb[2 * i + 1][0] = Mma::pack(b.x, b.y);
        qb[2 * i + 1][1] = Mma::pack(b.z, b.w);
    }
}

// One warp step of 16 keys, in two halves: first the scores of keys g and g + 8 (`in0`,
// `in8`: whether they are in the chunk; those not are masked) for columns 2t and 2t + 1...
template <typename KV, int D>
__device__ __forceinline__ void mma_step_scores(const uint4 (&kw)[2][D / 32],
                                                const unsigned (&qb)[D / 16][2], bool in0,
                                                bool in8, float scale, float (&s)[4]) {
    using Mma = Mma16<KV>;
    // s: keys g, g + 8 × heads 2t, 2t + 1 (c0 c1, c2 c3).
    s[0] = s[1] = s[2] = s[3] = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
        const unsigned a0[4] = {kw[0][i].x, kw[1][i].x, kw[0][i].y, kw[1][i].y};
        Mma::mma(s, a0, qb[2 * i][0], qb[2 * i][1]);
        const unsigned a1[4] = {kw[0][i].z, kw[1][i].z, kw[0][i].w, kw[1][i].w};
        Mma::mma(s, a1, qb[2 * i + 1][0], qb[2 * i + 1][1]);
    }
    s[0] = in0 ? s[0] * scale : NEG_INF;
    s[1] = in0 ? s[1] * scale : NEG_INF;
    s[2] = in8 ? s[2] * scale : NEG_INF;
    s[3] = in8 ? s[3] * scale : NEG_INF;
}

// ... then, from them, the running maxima and sums rescaled (online softmax) and the weighted
// values added to `o`. The operands as loaded (see the top). Both halves are shared by the
// decode kernel and the prompt rows' (attention_prompt_rows.cu), which computes a chunk's
// scores before its values: the same instructions on the same operands, so the same bits.
template <typename KV, int D>
__device__ __forceinline__ void mma_step_values(const float (&s)[4], const uint4 (&vw)[4][D / 64],
                                                float (&o)[D / 16][4], float (&m_run)[2],
                                                float (&l_run)[2]) {
    using Mma = Mma16<KV>;
    float correction[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(s[r], s[r + 2]);
#pragma unroll
        for (int o_ = 4; o_ < 32; o_ *= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o_));
        // The step's first key is in the chunk, so the new maximum is finite.
        const float m_new = fmaxf(m_run[r], mx);
        correction[r] = __expf(m_run[r] - m_new);  // 0 on the first step (m = -inf)
        m_run[r] = m_new;
    }
    const float p0 = __expf(s[0] - m_run[0]), p1 = __expf(s[1] - m_run[1]);
    const float p2 = __expf(s[2] - m_run[0]), p3 = __expf(s[3] - m_run[1]);
    l_run[0] = l_run[0] * correction[0] + (p0 + p2);
    l_run[1] = l_run[1] * correction[1] + (p1 + p3);
    // p^T's B fragment: keys 2t, 2t + 1 (then + 8) of head g.
    const unsigned pb0 = transpose_8x8(Mma::pack(p0, p1));
    const unsigned pb1 = transpose_8x8(Mma::pack(p2, p3));
#pragma unroll
    for (int m = 0; m < D / 16; ++m) {
        o[m][0] *= correction[0];
        o[m][1] *= correction[1];
        o[m][2] *= correction[0];
        o[m][3] *= correction[1];
        const int p = m / 4, w = m % 4;
        // Rows g, g + 8 of d tile m (the low and high halves) of keys 2t and 2t + 1, then
        // of 2t + 8 and 2t + 9.
        const unsigned k0 = word_of(vw[0][p], w), k1 = word_of(vw[1][p], w);
        const unsigned k8 = word_of(vw[2][p], w), k9 = word_of(vw[3][p], w);
        const unsigned a[4] = {__byte_perm(k0, k1, 0x5410), __byte_perm(k0, k1, 0x7632),
                               __byte_perm(k8, k9, 0x5410), __byte_perm(k8, k9, 0x7632)};
        Mma::mma(o[m], a, pb0, pb1);
    }
}

// A whole step (the decode kernel's).
template <typename KV, int D>
__device__ __forceinline__ void mma_attend_step(const uint4 (&kw)[2][D / 32],
                                                const uint4 (&vw)[4][D / 64],
                                                const unsigned (&qb)[D / 16][2], bool in0,
                                                bool in8, float scale, float (&o)[D / 16][4],
                                                float (&m_run)[2], float (&l_run)[2]) {
    float s[4];
    mma_step_scores<KV, D>(kw, qb, in0, in8, scale, s);
    mma_step_values<KV, D>(s, vw, o, m_run, l_run);
}

// The sums of a warp's running sums over the 8 lanes of a t (every lane gets them).
__device__ __forceinline__ void mma_row_sums(float (&l_run)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int o_ = 4; o_ < 32; o_ *= 2) l_run[r] += __shfl_xor_sync(FULL_MASK, l_run[r], o_);
}

// Where value (m, c) of a lane's accumulator lies in its column's row of d values: the
// offset of values δ and δ + 1 (rows g and g + 8 of d tile m; c / 2 picks).
__device__ __forceinline__ int mma_value_offset(int m, int g) {
    return 64 * (m / 4) + 8 * g + 2 * (m % 4);
}

// A warp's running maxima, sums (over the 8 lanes of a t) and values of its 8 columns to
// shared memory, for the block's merge (chunk_value).
template <int D>
__device__ __forceinline__ void mma_warp_rows(int warp, int g, int t, const float (&o)[D / 16][4],
                                              const float (&m_run)[2], float (&l_run)[2],
                                              float (*warp_m)[DEC_MMA_ROWS],
                                              float (*warp_l)[DEC_MMA_ROWS],
                                              float (*warp_acc)[DEC_MMA_ROWS][D]) {
    mma_row_sums(l_run);
    if (g == 0) {
        warp_m[warp][2 * t] = m_run[0];
        warp_m[warp][2 * t + 1] = m_run[1];
        warp_l[warp][2 * t] = l_run[0];
        warp_l[warp][2 * t + 1] = l_run[1];
    }
#pragma unroll
    for (int m = 0; m < D / 16; ++m) {
        // Values δ and δ + 1 of heads 2t and 2t + 1.
        const int delta = mma_value_offset(m, g);
        *(float2*)&warp_acc[warp][2 * t][delta] = make_float2(o[m][0], o[m][2]);
        *(float2*)&warp_acc[warp][2 * t + 1][delta] = make_float2(o[m][1], o[m][3]);
    }
}

// grid, scratch and arguments as attention_decode's, with ROWS = 8; `d` is D and the cache
// and scratch are on 16 bytes (checked by the host).
template <typename KV, int D, bool FUSED, typename Wait>
__device__ __forceinline__ void attention_decode_mma(
    const float* __restrict__ q, KV* __restrict__ kc, KV* __restrict__ vc,
    float* __restrict__ part_ml, float* __restrict__ part_acc, unsigned* __restrict__ tickets,
    float* __restrict__ out, int context, const int* __restrict__ context_dev, int n_heads,
    int n_kv_heads, float scale, int target_splits, const KvPages& pages, const DecodeRope& rope,
    Wait wait) {
    const int ROWS = DEC_MMA_ROWS, KEYS = DEC_MMA_KEYS;
    const int E = D / 32;        // a lane's values of a row when it holds them in order (rope)
    const int SLICES = D / 16;   // k slices of the first product, d tiles of the second
    const int K_PARTS = D / 32;  // 16-byte loads a lane makes of a key row
    const int V_PARTS = D / 64;  // and of a value row

    if (context_dev) context = *context_dev;
    const int keys_per_split = decode_keys_per_split(context, target_splits);
    const int splits = (context + keys_per_split - 1) / keys_per_split;
    if ((int)blockIdx.x >= splits) return;  // a chunk past the context
    const int group = n_heads / n_kv_heads;
    const int row_blocks = (group + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / row_blocks;
    const int head0 = kvh * group + (blockIdx.y % row_blocks) * ROWS;
    const int rows = min(ROWS, kvh * group + group - head0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    // The chunk in hand: the block takes chunks blockIdx.x, + gridDim.x, ... (as attention_decode).
    int t_end = min(context, ((int)blockIdx.x + 1) * keys_per_split);
    const int stride = n_kv_heads * D;
    const KV* kh = kc + (size_t)kvh * D;
    const KV* vh = vc + (size_t)kvh * D;
    const int pos = context - 1;
    const int last_cached = FUSED ? pos - 1 : pos;

    // As in attention_decode: a lane a row of a batch, asked of L2 some batches ahead; the first
    // two before the wait.
    auto prefetch = [&](int t0) {
        const int tk = t0 + (lane >> 1);
        if (tk < t_end && tk <= last_cached)
            prefetch_l2_lines(((lane & 1) ? vh : kh) + kv_row(pages, tk, stride), D * sizeof(KV));
    };
    const int step = DEC_WARPS * KEYS;
    int first = blockIdx.x * keys_per_split + warp * KEYS;
    // The block whose chunks include the last, which holds the step's own key, and whether the
    // chunk in hand is that one.
    const bool holds_new = FUSED && (splits - 1) % (int)gridDim.x == (int)blockIdx.x;
    bool has_new = holds_new && t_end == context;

    // A step's operands as loaded: this lane's 16-byte parts of keys g and g + 8 and of values
    // 2t, 2t + 1, 2t + 8 and 2t + 9 (see the top). `fetch` takes the cached rows (zero past the
    // chunk: finite, and masked), `patch` then the step's own row from shared memory.
    uint4 kw[2][K_PARTS], vw[4][V_PARTS];
    auto fetch = [&](int t0) {
        // t0 is a multiple of KEYS (chunks and warps start on them).
        const size_t block = t0 < t_end && t0 <= last_cached ? step_block(pages, t0) : 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int tk = t0 + g + 8 * h;
            const bool cached = tk < t_end && tk <= last_cached;
            const KV* row = kh + (cached ? step_row(pages, block, tk, stride) : 0);
#pragma unroll
            for (int i = 0; i < K_PARTS; ++i)
                kw[h][i] = cached ? load_stream16(row + 8 * (4 * i + t)) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int tk = t0 + 2 * t + (k & 1) + 8 * (k >> 1);
            const bool cached = tk < t_end && tk <= last_cached;
            const KV* row = vh + (cached ? step_row(pages, block, tk, stride) : 0);
#pragma unroll
            for (int p = 0; p < V_PARTS; ++p)
                vw[k][p] = cached ? load_stream16(row + 64 * p + 8 * g) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    __shared__ __align__(16) KV new_s[2][D];  // the step's key and value as the cache holds them
    auto patch = [&](int t0) {
        if (!has_new || pos - t0 >= KEYS || pos < t0) return;  // uniform across the warp
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < K_PARTS; ++i)
                if (t0 + g + 8 * h == pos) kw[h][i] = *(const uint4*)&new_s[0][8 * (4 * i + t)];
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int p = 0; p < V_PARTS; ++p)
                if (t0 + 2 * t + (k & 1) + 8 * (k >> 1) == pos)
                    vw[k][p] = *(const uint4*)&new_s[1][64 * p + 8 * g];
    };

    // Before waiting on the kernel before (the projections), what it does not write: fused,
    // the first step's cached rows themselves (earlier steps stored them), so their latency
    // hides in its tail; the next steps' asked of L2; the rope's tables.
    if (FUSED) fetch(first);
    else prefetch(first);
    prefetch(first + step);
    LaneRope<E> lr;
    if (FUSED) lr = lane_rope<E>(rope, lane, D, pos);
    wait();

    // The queries, normalised and rotated where fused, through shared memory into the order
    // the first product takes them; the step's key and value as the cache will hold them.
    __shared__ __align__(16) float q_s[ROWS][D];
    for (int r = warp; r < ROWS; r += DEC_WARPS) {
        float x[E];
#pragma unroll
        for (int j = 0; j < E; ++j) x[j] = r < rows ? q[(size_t)(head0 + r) * D + lane * E + j] : 0.0f;
        if (FUSED && r < rows)
            norm_rotate<E>(x, lr, lr.q_norm, rope.q_norm != nullptr, rope.pairs, rope.eps, lane, D);
#pragma unroll
        for (int j = 0; j < E; ++j) q_s[r][lane * E + j] = x[j];
    }
    if (holds_new && warp == 0) {
        float k_new[E], v_new[E];
#pragma unroll
        for (int j = 0; j < E; ++j) {
            k_new[j] = rope.k_new[(size_t)kvh * D + lane * E + j];
            v_new[j] = rope.v_new[(size_t)kvh * D + lane * E + j];
        }
        norm_rotate<E>(k_new, lr, lr.k_norm, rope.k_norm != nullptr, rope.pairs, rope.eps, lane, D);
        const bool stores = blockIdx.y % row_blocks == 0 && pos < pages.capacity;
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const int e = lane * E + j;
            const KV kq = from_f32<KV>(k_new[j]), vq = from_f32<KV>(v_new[j]);
            new_s[0][e] = kq;
            new_s[1][e] = vq;
            if (stores) {
                kc[kv_row(pages, pos, stride) + (size_t)kvh * D + e] = kq;
                vc[kv_row(pages, pos, stride) + (size_t)kvh * D + e] = vq;
            }
        }
    }
    __syncthreads();
    unsigned qb[SLICES][2];
    mma_query_fragments<KV, D>(q_s[g], true, t, qb);

    int done = 0;
    for (int split = blockIdx.x; split < splits; split += gridDim.x, ++done) {
        t_end = min(context, (split + 1) * keys_per_split);
        first = split * keys_per_split + warp * KEYS;
        has_new = holds_new && t_end == context;
        if (done > 0) {
            prefetch(first);
            prefetch(first + step);
        }
        float o[SLICES][4];
#pragma unroll
        for (int m = 0; m < SLICES; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.0f;
        // Heads 2t and 2t + 1: running maximum and this lane's share of the sum (keys g, g + 8).
        float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
        for (int t0 = first; t0 < t_end; t0 += step) {
            if (!FUSED || done > 0 || t0 != first) fetch(t0);
            patch(t0);
            prefetch(t0 + 2 * step);

            mma_attend_step<KV, D>(kw, vw, qb, t0 + g < t_end, t0 + g + 8 < t_end, scale, o,
                                   m_run, l_run);
        }

        // The warp's rows to shared memory.
        __shared__ float warp_m[DEC_WARPS][ROWS], warp_l[DEC_WARPS][ROWS];
        __shared__ __align__(16) float warp_acc[DEC_WARPS][ROWS][D];
        mma_warp_rows<D>(warp, g, t, o, m_run, l_run, warp_m, warp_l, warp_acc);
        __syncthreads();
        decode_chunk_done<ROWS, D>(warp_m, warp_l, warp_acc, rows, D, head0, split, splits, n_heads,
                                   part_ml, part_acc, out);
        __syncthreads();  // the shared rows are the next chunk's
    }
    decode_merge<ROWS>(rows, D, head0, splits, done, n_heads, part_ml, part_acc, tickets, out);
}

// The same arguments as attention_decode's entry points; `d` must be D and `vec` 1.
#define ATTENTION_DECODE_MMA_ENTRY(NAME, KV, D, FUSED)                                          \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) NAME(                             \
        const float* q, KV* kc, KV* vc, float* part_ml, float* part_acc, unsigned* tickets,     \
        float* out, int context, const int* context_dev, int n_heads, int n_kv_heads, int d,    \
        float scale, int target_splits, int vec, KvPages pages, DecodeRope rope,                \
        const DecodeBatch batch) {                                                              \
        decode_batch_row(batch, n_heads, n_kv_heads, d, q, out, part_ml, part_acc, tickets,     \
                         context, context_dev, pages, rope);                                    \
        attention_decode_mma<KV, D, FUSED>(q, kc, vc, part_ml, part_acc, tickets, out, context, \
                                           context_dev, n_heads, n_kv_heads, scale,             \
                                           target_splits, pages, rope,                          \
                                           [] { grid_dependency_wait(); });                     \
    }
#define ATTENTION_DECODE_MMA(T, KV, D)                                                          \
    ATTENTION_DECODE_MMA_ENTRY(attention_decode_mma_##T##_d##D, KV, D, false)                   \
    ATTENTION_DECODE_MMA_ENTRY(attention_decode_mma_rope_##T##_d##D, KV, D, true)
#define ATTENTION_DECODE_MMA_ALL(T, KV)                                                         \
    ATTENTION_DECODE_MMA(T, KV, 64)                                                             \
    ATTENTION_DECODE_MMA(T, KV, 128)

// Instantiated per 16-bit cache type by the module (kernels.rs appends
// `ATTENTION_DECODE_MMA_ALL(bf16, bf16_t)` or the f16 one).
