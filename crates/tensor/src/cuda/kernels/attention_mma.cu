// Causal attention of a prompt chunk on the tensor cores (sm_80 and later): FlashAttention-2's
// forward pass with 16-bit operands and f32 sums, for heads of D = 64 or 128 values.
//
// Layouts as in attention.cu: queries and outputs [n, n_heads, D] f32, the cache of one layer
// rows of [n_kv_heads, D] (f32, bf16 or f16) in the sequence's blocks; query i is at position pos0 + i and sees
// keys 0..=pos0 + i; query head h reads kv head h / (n_heads / n_kv_heads).
//
// A block of 4 warps takes 64 queries of one head, a warp 16 of them, whose fragments it keeps
// in registers for the whole pass. Keys and values come in tiles of 64 through two stages of
// shared memory, so the next tile's copy runs under this tile's products: a 16-bit cache is
// copied as it is (cp.async), an f32 cache is rounded to bf16 on the way. Both tiles are stored
// as the cache stores them (a key's or value's D values in a row); ldmatrix gives the keys as
// the first product's B fragments and, transposed, the values as the second's. Per tile each
// warp computes its 16×64 scores with mma.m16n8k16, masks the diagonal, updates the running
// max and sum in the log2 domain (online softmax), and feeds the probabilities straight from
// the score registers into the P·V product (an m16n8 accumulator is laid out as the m16k16
// operand needs). Rows past the last query are computed on clamped inputs and not written.
//
// Operands are the cache's 16-bit type (bf16 for an f32 cache): the queries and the
// probabilities are rounded to it, as transformers' 16-bit attention rounds them.
//
// H200, 32/8 heads of 128, bf16 cache (cuda_probe, causal FLOPs): 512 queries after 1536
// positions 91 µs (165 TFLOP/s), 2048 from 0 225 µs (153), 8192 from 0 2.65 ms (208); an f32
// cache 104-115 TFLOP/s. The first form of this kernel (values transposed through registers
// into shared memory, one stage, no overlap of copy and products) took 318 µs on the first of
// these, ~12 TFLOP/s: 35% of qwen3-8b's prefill.

#define MMA_ROWS 64
#define MMA_KEYS 64
#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * 32)
#define MMA_STAGES 2
// Padding of a shared row in 16-bit values: 16 bytes, so the 8 rows an ldmatrix reads start in
// 8 different bank quads.
#define MMA_PAD 8

// Copies keys t0..t0 + 63 of one kv head (at `head` values into each cache row) into a stage's
// K and V tiles, rows of D + MMA_PAD values; keys at or past `keys` are zeros.
template <typename KV, int D> struct StageTile {
    // 16-bit caches: 16-byte asynchronous copies, complete after cp_async_wait.
    static __device__ __forceinline__ void copy(unsigned short* ks, unsigned short* vs,
                                                const KV* kc, const KV* vc, int t0, int keys,
                                                int kv_stride, int head, const KvPages& pages) {
        const int CHUNKS = D / 8;  // 16-byte pieces of a row
#pragma unroll
        for (int i = 0; i < MMA_KEYS * CHUNKS / MMA_THREADS; ++i) {
            const int idx = threadIdx.x + i * MMA_THREADS;
            const int j = idx / CHUNKS, c = (idx % CHUNKS) * 8;
            const bool valid = t0 + j < keys;
            const size_t off = valid ? kv_row(pages, t0 + j, kv_stride) + head + c : 0;
            cp_async_16(shared_address(ks + j * (D + MMA_PAD) + c), kc + off, valid);
            cp_async_16(shared_address(vs + j * (D + MMA_PAD) + c), vc + off, valid);
        }
    }
};
template <int D> struct StageTile<float, D> {
    // An f32 cache: read, round to bf16 and store, so complete when the call returns.
    static __device__ __forceinline__ uint4 rounded(const float* p) {
        const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
        return make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y),
                          pack_bf16(b.z, b.w));
    }
    static __device__ __forceinline__ void copy(unsigned short* ks, unsigned short* vs,
                                                const float* kc, const float* vc, int t0,
                                                int keys, int kv_stride, int head,
                                                const KvPages& pages) {
        const int CHUNKS = D / 8;
        for (int i = 0; i < MMA_KEYS * CHUNKS / MMA_THREADS; ++i) {
            const int idx = threadIdx.x + i * MMA_THREADS;
            const int j = idx / CHUNKS, c = (idx % CHUNKS) * 8;
            uint4 k8 = make_uint4(0, 0, 0, 0), v8 = k8;
            if (t0 + j < keys) {
                const size_t off = kv_row(pages, t0 + j, kv_stride) + head + c;
                k8 = rounded(kc + off);
                v8 = rounded(vc + off);
            }
            *(uint4*)(ks + j * (D + MMA_PAD) + c) = k8;
            *(uint4*)(vs + j * (D + MMA_PAD) + c) = v8;
        }
    }
};

// grid: (ceil(n / 64), n_heads, splits); MMA_THREADS threads; dynamic shared memory for
// MMA_STAGES stages of a K and a V tile (Kernel::dynamic_smem_bytes). With one split the
// block writes its rows' outputs; with more (a short chunk over a long cache, whose few
// blocks would leave most of the GPU idle), split z takes keys z·keys_per_split.. (a multiple
// of MMA_KEYS) and writes its unnormalised partial result to `part` (PrefillPart, attention.cu)
// for attention_prefill_combine.
template <typename KV, int D>
__device__ __forceinline__ void attention_prefill_mma(const float* __restrict__ q,
                                                      const KV* __restrict__ kc,
                                                      const KV* __restrict__ vc,
                                                      float* __restrict__ out, int n, int pos0,
                                                      int n_heads, int n_kv_heads, float scale,
                                                      const KvPages& pages, int keys_per_split,
                                                      float* __restrict__ part) {
    using Mma = Mma16<KV>;
    const int ROW = D + MMA_PAD;      // a shared row, in 16-bit values
    const int TILE = MMA_KEYS * ROW;  // a K or V tile
    extern __shared__ __align__(16) unsigned short tiles[];  // stage s: K at 2s, V at 2s + 1

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;  // the fragment's row group and pair
    const int h = blockIdx.y, kvh = h / (n_heads / n_kv_heads);
    // The last query blocks see the most keys: they start first, so the short ones fill in.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * MMA_ROWS, w0 = q0 + warp * 16;
    const int q_stride = n_heads * D, kv_stride = n_kv_heads * D;
    // log2 domain: exp(x · scale) = exp2(x · scale · log2 e).
    const float scale_log2 = scale * 1.4426950408889634f;

    // This warp's 16 query rows as A fragments, one per 16 values of the head.
    unsigned qa[D / 16][4];
    {
        const float* r0 = q + (size_t)min(w0 + g, n - 1) * q_stride + h * D;
        const float* r8 = q + (size_t)min(w0 + g + 8, n - 1) * q_stride + h * D;
#pragma unroll
        for (int k = 0; k < D / 16; ++k) {
            const int c = k * 16 + 2 * t;
            qa[k][0] = Mma::pack(r0[c], r0[c + 1]);
            qa[k][1] = Mma::pack(r8[c], r8[c + 1]);
            qa[k][2] = Mma::pack(r0[c + 8], r0[c + 9]);
            qa[k][3] = Mma::pack(r8[c + 8], r8[c + 9]);
        }
    }
    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // Rows g and g + 8 of the warp: running max (log2 domain) and sum.
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    // Positions of those rows: they see keys up to and including these.
    const int p_row[2] = {pos0 + w0 + g, pos0 + w0 + g + 8};
    // The warp's first row sees this tile's keys only up to here.
    const int warp_first = pos0 + w0, warp_last = pos0 + min(w0 + 15, n - 1);

    // Byte offsets of this lane's ldmatrix row in a tile. Keys (first product): matrix
    // l / 8 is values 8(l / 8).. of 8 keys, so one x4 holds two k steps of an n tile. Values
    // (second, transposed): matrices (keys 0-7, 8-15) × (values 0-7, 8-15), so one x4 holds
    // both k halves of two n tiles.
    const int mi = lane >> 3, mr = lane & 7;
    const unsigned k_lane = (mr * ROW + mi * 8) * 2;
    const unsigned v_lane = (((mi & 1) * 8 + mr) * ROW + (mi >> 1) * 8) * 2;
    const unsigned tiles_at = shared_address(tiles);

    const int keys = pos0 + min(n, q0 + MMA_ROWS);  // the block's last query sees these
    // This split's tiles (a split past the block's keys has none: its rows stay empty).
    const int split_tiles = keys_per_split / MMA_KEYS;
    const int first_tile = blockIdx.z * split_tiles;
    const int n_tiles = min((keys + MMA_KEYS - 1) / MMA_KEYS, first_tile + split_tiles);
    if (first_tile < n_tiles)
        StageTile<KV, D>::copy(tiles, tiles + TILE, kc, vc, first_tile * MMA_KEYS, keys,
                               kv_stride, kvh * D, pages);
    cp_async_commit();
    for (int tile = first_tile; tile < n_tiles; ++tile) {
        const int t0 = tile * MMA_KEYS, stage = (tile - first_tile) & 1;
        if (tile + 1 < n_tiles) {
            // The other stage was last read in the previous tile, behind its closing barrier.
            unsigned short* next = tiles + 2 * (stage ^ 1) * TILE;
            StageTile<KV, D>::copy(next, next + TILE, kc, vc, t0 + MMA_KEYS, keys, kv_stride,
                                   kvh * D, pages);
        }
        cp_async_commit();
        cp_async_wait<1>();  // this tile's copies have landed (the next one's may not have)
        __syncthreads();
        // A warp whose rows see none of this tile has nothing to add.
        if (t0 <= warp_last) {
            const unsigned k_at = tiles_at + 2 * stage * TILE * 2 + k_lane;
            const unsigned v_at = tiles_at + (2 * stage + 1) * TILE * 2 + v_lane;
            // Scores: 16 rows × 64 keys, as 8 accumulator tiles of 16×8.
            float s[MMA_KEYS / 8][4];
#pragma unroll
            for (int j = 0; j < MMA_KEYS / 8; ++j) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
                for (int k = 0; k < D / 32; ++k) {
                    unsigned b[4];
                    ldmatrix_x4(b, k_at + (j * 8 * ROW + k * 32) * 2);
                    Mma::mma(s[j], qa[2 * k], b[0], b[1]);
                    Mma::mma(s[j], qa[2 * k + 1], b[2], b[3]);
                }
            }
            // Scale, mask the keys past a row's position (only where the tile reaches the
            // warp's diagonal), and the tile's row maxima (over the 4 lanes sharing a row).
            const bool diagonal = t0 + MMA_KEYS - 1 > warp_first;
            float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int j = 0; j < MMA_KEYS / 8; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = i >> 1, key = t0 + j * 8 + 2 * t + (i & 1);
                    const float v = diagonal && key > p_row[r] ? NEG_INF : s[j][i] * scale_log2;
                    s[j][i] = v;
                    tile_max[r] = fmaxf(tile_max[r], v);
                }
            float correction[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(FULL_MASK, tile_max[r], 1));
                tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(FULL_MASK, tile_max[r], 2));
                const float m_new = fmaxf(m[r], tile_max[r]);
                // Key 0 is in every row's first tile, so m_new is finite for every real row
                // unsplit; a split may hold no key of a row (it stays empty: m = -inf, l = 0),
                // and clamped rows past the chunk may see nothing (and are not written).
                correction[r] = m_new == NEG_INF ? 1.0f : exp2f(m[r] - m_new);
                m[r] = m_new;
            }
            float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < MMA_KEYS / 8; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = i >> 1;
                    const float p = s[j][i] == NEG_INF ? 0.0f : exp2f(s[j][i] - m[r]);
                    s[j][i] = p;
                    row_sum[r] += p;
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                row_sum[r] += __shfl_xor_sync(FULL_MASK, row_sum[r], 1);
                row_sum[r] += __shfl_xor_sync(FULL_MASK, row_sum[r], 2);
                l[r] = l[r] * correction[r] + row_sum[r];
            }
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                o[j][0] *= correction[0];
                o[j][1] *= correction[0];
                o[j][2] *= correction[1];
                o[j][3] *= correction[1];
            }
            // O += P · V, 16 keys at a time: score tiles 2k and 2k + 1 are the A fragment.
#pragma unroll
            for (int k = 0; k < MMA_KEYS / 16; ++k) {
                const unsigned pa[4] = {Mma::pack(s[2 * k][0], s[2 * k][1]),
                                        Mma::pack(s[2 * k][2], s[2 * k][3]),
                                        Mma::pack(s[2 * k + 1][0], s[2 * k + 1][1]),
                                        Mma::pack(s[2 * k + 1][2], s[2 * k + 1][3])};
#pragma unroll
                for (int j = 0; j < D / 16; ++j) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, v_at + (k * 16 * ROW + j * 16) * 2);
                    Mma::mma(o[2 * j], pa, b[0], b[1]);
                    Mma::mma(o[2 * j + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // this stage is free for the tile after next
    }

    // Rows g and g + 8, columns 2t and 2t + 1 of each 8-wide tile.
    if (gridDim.z > 1) {
        // m is in the log2 domain, as attention_prefill_combine is told.
        const PrefillPart p(part, gridDim.z, n, n_heads, D);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = w0 + g + 8 * r;
            if (row >= n) continue;
            float* dst = p.acc(blockIdx.z, row, h);
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
                *(float2*)&dst[j * 8 + 2 * t] = make_float2(o[j][2 * r], o[j][2 * r + 1]);
            if (t == 0) {
                float* ml = p.ml(blockIdx.z, row, h);
                ml[0] = m[r];
                ml[1] = l[r];
            }
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = w0 + g + 8 * r;
        if (row >= n) continue;
        const float inv = 1.0f / l[r];
        float* dst = out + (size_t)row * q_stride + h * D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int c = j * 8 + 2 * t;
            *(float2*)&dst[c] = make_float2(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
        }
    }
}

#define ATTENTION_MMA(T, KV, D)                                                                \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS) attention_prefill_mma_##T##_d##D( \
        const float* q, const KV* kc, const KV* vc, float* out, int n, int pos0, int n_heads,  \
        int n_kv_heads, float scale, const KvPages pages, int keys_per_split, float* part) {   \
        grid_dependency_wait();                                                                \
        attention_prefill_mma<KV, D>(q, kc, vc, out, n, pos0, n_heads, n_kv_heads, scale,      \
                                     pages, keys_per_split, part);                             \
    }
#define ATTENTION_MMA_ALL_DIMS(T, KV) ATTENTION_MMA(T, KV, 64) ATTENTION_MMA(T, KV, 128)

ATTENTION_MMA_ALL_DIMS(f32, float)
ATTENTION_MMA_ALL_DIMS(bf16, bf16_t)
ATTENTION_MMA_ALL_DIMS(f16, f16_t)
