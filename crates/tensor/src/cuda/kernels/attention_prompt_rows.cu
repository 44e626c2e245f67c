// Batch-invariant prompt attention on the tensor cores: every row of a prompt chunk gets the
// bits that the tensor-core decode kernel (attention_decode_mma.cu, before this file in its
// module) gives it as a decode row, but each chunk of keys is read once for many rows, not
// once a row.
//
// A decode row's result is fixed by its context alone: chunks of decode_keys_per_split keys
// (128 up to contexts of 128 · min(target_splits, 64), the only ones this kernel takes: the
// host sends longer rows the decode kernel's way); in a chunk, decode warp w's steps of 16
// keys (w·16, then + 64), each step's two products with a column of the mma per query head;
// the warps merged (chunk_value), then the chunks in order (merge_chunks). A column of an mma
// never meets another column's operands (each output element is its own sum), so the 8
// columns a decode block gives to the heads of one row (half of them idle under a group of
// 4) can hold the heads of 8 / group rows: a "set". The keys are the operand the columns
// share, so a set's columns must see the same keys: rows that see the whole chunk share sets;
// a row whose context ends inside the chunk has a set of its own, its keys past the end zero,
// as the decode kernel loads them.
//
// Here one warp does a set's whole chunk, all four decode warps' work in turn, so that no
// warp waits on another: first every step's scores (kept in registers, 4 a lane a step),
// whose maximum is the chunk's (chunk_value's maximum of the warps' maxima: a maximum does
// not depend on the order it is taken in); then each decode warp's two steps from its scores
// (mma_step_values: the same instructions on the same operands), its sums and values merged
// into the set's as chunk_value merges them, in warp order. Decode's block merges through
// shared memory after a block barrier; here the merge is a lane's own registers.
//
// grid: (chunks of the launch's last row, n_kv_heads · blocks of 8 heads of a group, tiles
// of PR_TILE_ROWS rows). A block stages its chunk of its kv head's keys and values in shared
// memory (cp.async; each row's 16-byte units swizzled so that the fragment loads below meet no
// bank conflict), then its warps take the tile's sets, set w, w + 4, ... A row of one chunk
// writes its output; the others write their chunk's partial result to the scratch, which
// attention_prompt_rows_merge then merges as decode_merge would.

#define PR_TILE_ROWS 32
// Blocks of a multiprocessor (a chunk's keys and values, 64 KiB at D = 128, three fit): the
// registers are capped to let them, and four warps each do not hide shared memory's latency.
#define PR_BLOCKS_PER_SM 3

// Row `row`'s partial results in the launch's scratch, for launches whose last row has
// `splits` chunks: [splits, n_heads, 2] maxima and sums (padded to 16 bytes), then [splits,
// n_heads, d] values, as a decode row's scratch holds them. Mirrors `row_slab` in
// prompt_rows.rs.
__device__ __forceinline__ void prompt_row_parts(float* scratch, int row, int splits,
                                                 int n_heads, int d, float*& part_ml,
                                                 float*& part_acc) {
    const size_t ml = ((size_t)splits * n_heads * 2 + 3) / 4 * 4;
    const size_t slab = ml + (size_t)splits * n_heads * d;
    part_ml = scratch + (size_t)row * slab;
    part_acc = part_ml + ml;
}

// Where 16-byte unit u of staged row k lies: u ^ swizzle(k). A fragment load's quarter warp
// reads two neighbouring rows' units {4i .. 4i + 3} (keys) or four rows 2 apart's units
// {2j, 2j + 1} (values); this spreads either over the 8 distinct 16-byte bank groups.
__device__ __forceinline__ int unit_swizzle(int k) { return ((k & 1) << 2) ^ (((k >> 1) & 3) << 1); }

// `wait` is the entry point's grid_dependency_wait(): the cache was written by the launch
// before (kv_store).
template <typename KV, int D, typename Wait>
__device__ __forceinline__ void attention_prompt_rows_mma(
    const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
    float* __restrict__ scratch, float* __restrict__ out, int pos0, int n_rows, int splits_max,
    int n_heads, int n_kv_heads, float scale, const KvPages& pages, Wait wait) {
    const int ROWS = DEC_MMA_ROWS, KEYS = DEC_MMA_KEYS, CHUNK = DEC_MIN_KEYS_PER_SPLIT;
    const int K_PARTS = D / 32, V_PARTS = D / 64, UNITS = D / 8, SLICES = D / 16;
    // Step j of a chunk (keys 16j ..) is decode warp j % DEC_WARPS's (j / DEC_WARPS)th.
    const int STEPS = CHUNK / KEYS, WARP_STEPS = STEPS / DEC_WARPS;
    const int c = blockIdx.x, chunk0 = c * CHUNK;
    const int i0 = blockIdx.z * PR_TILE_ROWS, i1 = min(n_rows, i0 + PR_TILE_ROWS);
    // Row i (position pos0 + i) has chunk c when its context, pos0 + i + 1, passes chunk0; it
    // sees the chunk whole from row whole_from on.
    const int first_row = max(i0, chunk0 - pos0);
    if (first_row >= i1) return;
    const int whole_from = min(i1, max(first_row, chunk0 + CHUNK - 1 - pos0));
    const int t_max = min(pos0 + i1, chunk0 + CHUNK);  // past the tile's last key of the chunk
    const int group = n_heads / n_kv_heads;
    const int row_blocks = (group + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / row_blocks;
    const int head0 = kvh * group + (blockIdx.y % row_blocks) * ROWS;
    const int heads = min(ROWS, kvh * group + group - head0);  // of each row of a set
    const int per_set = ROWS / heads;                           // rows of a whole set
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int stride = n_kv_heads * D;

    wait();
    extern __shared__ __align__(16) unsigned char prompt_rows_smem[];
    KV* ks = (KV*)prompt_rows_smem;
    KV* vs = ks + CHUNK * D;
    for (int i = threadIdx.x; i < CHUNK * UNITS; i += DEC_THREADS) {
        const int k = i / UNITS, u = i - k * UNITS;
        const bool in = chunk0 + k < t_max;
        const size_t at = in ? kv_row(pages, chunk0 + k, stride) + (size_t)kvh * D + 8 * u : 0;
        const int dst = k * D + 8 * (u ^ unit_swizzle(k));
        cp_async_16(shared_address(ks + dst), kc + at, in);
        cp_async_16(shared_address(vs + dst), vc + at, in);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    const int partial_sets = whole_from - first_row;
    const int sets = partial_sets + (i1 - whole_from + per_set - 1) / per_set;
    for (int set = warp; set < sets; set += DEC_WARPS) {
        // The set's rows and the end of the keys they see.
        const bool partial = set < partial_sets;
        const int row0 = partial ? first_row + set : whole_from + (set - partial_sets) * per_set;
        const int set_rows = partial ? 1 : min(per_set, i1 - row0);
        const int t_end = partial ? pos0 + row0 + 1 : chunk0 + CHUNK;
        // Column n = r · heads + h: head head0 + h of row row0 + r; zero past the set's.
        unsigned qb[SLICES][2];
        {
            const int r = g / heads, h = g - r * heads;
            const float* col = q + ((size_t)(row0 + r) * n_heads + head0 + h) * D;
            mma_query_fragments<KV, D>(col, r < set_rows, t, qb);
        }
        // Every step's scores, and the chunk's maximum of each of this lane's two columns.
        float s[STEPS][4];
        float mm[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int j = 0; j < STEPS; ++j) {
            const int t0 = chunk0 + j * KEYS;
            if (t0 >= t_end) continue;  // no decode warp's step (uniform across the warp)
            uint4 kw[2][K_PARTS];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int k = j * KEYS + g + 8 * h;
                const bool in = chunk0 + k < t_end;
#pragma unroll
                for (int i = 0; i < K_PARTS; ++i)
                    kw[h][i] = in ? *(const uint4*)(ks + k * D + 8 * ((4 * i + t) ^ unit_swizzle(k)))
                                  : make_uint4(0u, 0u, 0u, 0u);
            }
            mma_step_scores<KV, D>(kw, qb, t0 + g < t_end, t0 + g + 8 < t_end, scale, s[j]);
            mm[0] = fmaxf(mm[0], fmaxf(s[j][0], s[j][2]));
            mm[1] = fmaxf(mm[1], fmaxf(s[j][1], s[j][3]));
        }
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int o_ = 4; o_ < 32; o_ *= 2) mm[r] = fmaxf(mm[r], __shfl_xor_sync(FULL_MASK, mm[r], o_));
        // Each decode warp's steps, then its share merged in (chunk_value's arithmetic).
        float acc[SLICES][4], sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int m = 0; m < SLICES; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) {
            float o[SLICES][4];
#pragma unroll
            for (int m = 0; m < SLICES; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.0f;
            float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
#pragma unroll
            for (int step = 0; step < WARP_STEPS; ++step) {
                const int j = w + step * DEC_WARPS;
                if (chunk0 + j * KEYS >= t_end) continue;
                uint4 vw[4][V_PARTS];
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    const int k = j * KEYS + 2 * t + (kk & 1) + 8 * (kk >> 1);
                    const bool in = chunk0 + k < t_end;
#pragma unroll
                    for (int p = 0; p < V_PARTS; ++p)
                        vw[kk][p] = in ? *(const uint4*)(vs + k * D + 8 * ((8 * p + g) ^ unit_swizzle(k)))
                                       : make_uint4(0u, 0u, 0u, 0u);
                }
                mma_step_values<KV, D>(s[j], vw, o, m_run, l_run);
            }
            mma_row_sums(l_run);
            // 0 for a decode warp that saw no key (m_run = -inf), as in chunk_value.
            const float f[2] = {__expf(m_run[0] - mm[0]), __expf(m_run[1] - mm[1])};
            sum[0] = fmaf(f[0], l_run[0], sum[0]);
            sum[1] = fmaf(f[1], l_run[1], sum[1]);
#pragma unroll
            for (int m = 0; m < SLICES; ++m)
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[m][v] = fmaf(f[v & 1], o[m][v], acc[m][v]);
        }
        // This lane's columns 2t and 2t + 1: a row of one chunk's output, else the chunk's
        // partial result.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int n = 2 * t + r, rr = n / heads;
            if (rr >= set_rows) continue;
            const int row = row0 + rr, h = head0 + n - rr * heads;
            if (pos0 + row + 1 <= CHUNK) {
                float* dst = out + ((size_t)row * n_heads + h) * D;
#pragma unroll
                for (int m = 0; m < SLICES; ++m)
                    *(float2*)&dst[mma_value_offset(m, g)] =
                        make_float2(acc[m][r] / sum[r], acc[m][r + 2] / sum[r]);
                continue;
            }
            float *part_ml, *part_acc;
            prompt_row_parts(scratch, row, splits_max, n_heads, D, part_ml, part_acc);
            const size_t part = (size_t)c * n_heads + h;
            float* dst = part_acc + part * D;
#pragma unroll
            for (int m = 0; m < SLICES; ++m)
                *(float2*)&dst[mma_value_offset(m, g)] = make_float2(acc[m][r], acc[m][r + 2]);
            if (g == 0) {
                part_ml[2 * part] = mm[r];
                part_ml[2 * part + 1] = sum[r];
            }
        }
    }
}

// grid: (the launch's rows, n_kv_heads · blocks of 8 heads of a group). Each row of more than
// one chunk merges its chunks for the block's heads, as decode_merge merges a decode row's.
template <typename Wait>
__device__ __forceinline__ void attention_prompt_rows_merge(const float* __restrict__ scratch,
                                                            float* __restrict__ out, int pos0,
                                                            int splits_max, int n_heads,
                                                            int n_kv_heads, int d, Wait wait) {
    const int ROWS = DEC_MMA_ROWS;
    const int row = blockIdx.x;
    const int splits = (pos0 + row + 1 + DEC_MIN_KEYS_PER_SPLIT - 1) / DEC_MIN_KEYS_PER_SPLIT;
    if (splits == 1) return;  // written whole by the attention kernel
    const int group = n_heads / n_kv_heads;
    const int row_blocks = (group + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / row_blocks;
    const int head0 = kvh * group + (blockIdx.y % row_blocks) * ROWS;
    const int heads = min(ROWS, kvh * group + group - head0);
    wait();
    float *part_ml, *part_acc;
    prompt_row_parts((float*)scratch, row, splits_max, n_heads, d, part_ml, part_acc);
    merge_chunks<ROWS>(heads, d, head0, splits, n_heads, part_ml, part_acc,
                       out + (size_t)row * n_heads * d);
}

// q and out: the launch's rows, [n_rows, n_heads, D]; pages: the sequence's.
#define ATTENTION_PROMPT_ROWS_MMA(T, KV, D)                                                     \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, PR_BLOCKS_PER_SM) attention_prompt_rows_mma_##T##_d##D( \
        const float* q, const KV* kc, const KV* vc, float* scratch, float* out, int pos0,       \
        int n_rows, int splits_max, int n_heads, int n_kv_heads, float scale, KvPages pages) {  \
        attention_prompt_rows_mma<KV, D>(q, kc, vc, scratch, out, pos0, n_rows, splits_max,     \
                                         n_heads, n_kv_heads, scale, pages,                     \
                                         [] { grid_dependency_wait(); });                       \
    }
#define ATTENTION_PROMPT_ROWS_ALL(T, KV)                                                        \
    ATTENTION_PROMPT_ROWS_MMA(T, KV, 64)                                                        \
    ATTENTION_PROMPT_ROWS_MMA(T, KV, 128)                                                       \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) attention_prompt_rows_merge_##T(  \
        const float* scratch, float* out, int pos0, int splits_max, int n_heads,                \
        int n_kv_heads, int d) {                                                                \
        attention_prompt_rows_merge(scratch, out, pos0, splits_max, n_heads, n_kv_heads, d,     \
                                    [] { grid_dependency_wait(); });                            \
    }

// Instantiated per 16-bit cache type by the module, beside the decode kernels
// (`ATTENTION_PROMPT_ROWS_ALL(bf16, bf16_t)` or the f16 one).
