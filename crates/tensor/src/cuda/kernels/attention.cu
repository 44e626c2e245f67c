// Prompt attention of f32 queries over a KV cache of f32, bf16 or f16 (the tensor-core form is
// attention_mma.cu, one new token's is attention_decode.cu), and the cache's stores.
//
// The cache of one layer is rows of [n_kv_heads, d], a position's row found through the
// sequence's block table (KvPages, common.cuh); queries and outputs are [tokens, n_heads, d]
// f32; query head h reads kv head h / (n_heads / n_kv_heads).
//
// attention_prefill: causal attention of a prompt chunk of n tokens at positions pos0..pos0+n
// over the cache (which already holds them); a block takes 16 queries of one head. It walks
// the keys in tiles of 32 staged as f32 in shared memory. Within a tile a lane owns one key:
// it takes that key's score, the warp agrees on the tile's maximum, and the running (max,
// sum, weighted values) of each query row are rescaled once per tile (online softmax), so no
// score vector is ever stored. A lane holds E = ceil(d / 32) of a row's output values
// (elements lane, lane + 32, ...). A block has 4 warps and 16 rows, dealt round-robin (row r
// to warp r % 4).

#define ATT_TILE 32
#define ATT_WARPS 4
#define ATT_ROWS_PER_WARP 4
#define ATT_ROWS (ATT_WARPS * ATT_ROWS_PER_WARP)
#define ATT_THREADS (ATT_WARPS * 32)

template <int E> struct RowState {
    float m, l;
    float acc[E];
};

template <int E> __device__ __forceinline__ void row_init(RowState<E>& st) {
    st.m = NEG_INF;
    st.l = 0.0f;
#pragma unroll
    for (int j = 0; j < E; ++j) st.acc[j] = 0.0f;
}

// Shared memory of a block: the key tile (rows padded by one float so that lane t reading
// key t hits its own bank), the value tile, and the block's query rows.
template <int E> struct Smem {
    static const int DP = E * 32;
    float* k;  // [ATT_TILE][DP + 1]
    float* v;  // [ATT_TILE][DP]
    float* q;  // [ATT_ROWS][DP]
    __device__ __forceinline__ Smem(float* base) {
        k = base;
        v = k + ATT_TILE * (DP + 1);
        q = v + ATT_TILE * DP;
    }
};

// Keys and values t0..t0+count of one kv head into the tiles; the rest of the tile and the
// elements past d are zero, so they add nothing. With `vec` (d and every row start a whole
// number of 16-byte chunks, set by the host) each thread moves 16 bytes at a time, all its
// loads issued before the first store.
template <typename KV, int E>
__device__ __forceinline__ void load_tile(const Smem<E>& s, const KV* __restrict__ kc,
                                          const KV* __restrict__ vc, int t0, int count,
                                          int kv_stride, int offset, int d, int vec,
                                          const KvPages& pages) {
    const int DP = E * 32;
    if (vec) {
        const int N = Chunk<KV>::N, PER_ROW = DP / N;
#pragma unroll
        for (int idx = threadIdx.x; idx < ATT_TILE * PER_ROW; idx += ATT_THREADS) {
            const int t = idx / PER_ROW, e0 = (idx - t * PER_ROW) * N;
            float kf[N], vf[N];
            if (t < count && e0 < d) {
                const size_t o = kv_row(pages, t0 + t, kv_stride) + offset + e0;
                Chunk<KV>::unpack(*(const uint4*)(kc + o), kf);
                Chunk<KV>::unpack(*(const uint4*)(vc + o), vf);
            } else {
#pragma unroll
                for (int j = 0; j < N; ++j) kf[j] = vf[j] = 0.0f;
            }
#pragma unroll
            for (int j = 0; j < N; ++j) {
                s.k[t * (DP + 1) + e0 + j] = kf[j];
                s.v[t * DP + e0 + j] = vf[j];
            }
        }
        return;
    }
    for (int idx = threadIdx.x; idx < ATT_TILE * DP; idx += blockDim.x) {
        const int t = idx / DP, e = idx - t * DP;
        float kv = 0.0f, vv = 0.0f;
        if (t < count && e < d) {
            const size_t o = kv_row(pages, t0 + t, kv_stride) + offset + e;
            kv = to_f32(kc[o]);
            vv = to_f32(vc[o]);
        }
        s.k[t * (DP + 1) + e] = kv;
        s.v[t * DP + e] = vv;
    }
}

// Folds the first `visible` keys of the staged tile into one query row.
template <int E>
__device__ __forceinline__ void row_update(RowState<E>& st, const Smem<E>& s, int row,
                                           int visible, float scale) {
    const int DP = E * 32;
    const int lane = threadIdx.x & 31;
    float score = NEG_INF;
    if (lane < visible) {
        const float* q = s.q + row * DP;
        const float* k = s.k + lane * (DP + 1);
        // Four chains, so the FMAs do not wait on each other.
        float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
        for (int e = 0; e < DP; e += 4) {
#pragma unroll
            for (int j = 0; j < 4; ++j) dot[j] = fmaf(q[e + j], k[e + j], dot[j]);
        }
        score = ((dot[0] + dot[1]) + (dot[2] + dot[3])) * scale;
    }
    const float tile_max = warp_max(score);
    if (tile_max == NEG_INF) return;  // uniform across the warp
    const float m = fmaxf(st.m, tile_max);
    const float correction = __expf(st.m - m);  // 0 on the first tile (st.m = -inf)
    const float p = lane < visible ? __expf(score - m) : 0.0f;
    st.l = st.l * correction + warp_sum(p);
#pragma unroll
    for (int j = 0; j < E; ++j) st.acc[j] *= correction;
#pragma unroll 8
    for (int t = 0; t < ATT_TILE; ++t) {
        const float pt = __shfl_sync(FULL_MASK, p, t);
        const float* v = s.v + t * DP + lane;
#pragma unroll
        for (int j = 0; j < E; ++j) st.acc[j] = fmaf(pt, v[j * 32], st.acc[j]);
    }
    st.m = m;
}

// Copies a query row into the block's shared rows, zero past d (or all zero for no row).
template <int E>
__device__ __forceinline__ void stage_query(const Smem<E>& s, int row, const float* q, int d) {
    const int DP = E * 32;
    for (int e = threadIdx.x & 31; e < DP; e += 32) s.q[row * DP + e] = (q && e < d) ? q[e] : 0.0f;
}

// grid: (ceil(n / 16), n_heads, splits). With one split the block writes its rows' outputs;
// with more, split z takes keys z·keys_per_split.. (a multiple of ATT_TILE) and writes its
// unnormalised partial result (PrefillPart) for attention_prefill_combine.
template <typename KV, int E>
__device__ __forceinline__ void attention_prefill(const float* __restrict__ q,
                                                  const KV* __restrict__ kc,
                                                  const KV* __restrict__ vc,
                                                  float* __restrict__ out, int n, int pos0,
                                                  int n_heads, int n_kv_heads, int d,
                                                  float scale, int vec, const KvPages& pages,
                                                  int keys_per_split, float* __restrict__ part) {
    extern __shared__ float smem[];
    const Smem<E> s(smem);
    const int h = blockIdx.y;
    const int kvh = h / (n_heads / n_kv_heads);
    const int i0 = blockIdx.x * ATT_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int j = 0; j < ATT_ROWS_PER_WARP; ++j) {
        const int r = j * ATT_WARPS + warp, i = i0 + r;
        stage_query<E>(s, r, i < n ? q + ((size_t)i * n_heads + h) * d : 0, d);
    }
    RowState<E> st[ATT_ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ATT_ROWS_PER_WARP; ++i) row_init<E>(st[i]);

    const int keys = pos0 + min(n, i0 + ATT_ROWS);  // the block's last query sees these
    const int first_key = blockIdx.z * keys_per_split;
    const int end = min(keys, first_key + keys_per_split);
    for (int t0 = first_key; t0 < end; t0 += ATT_TILE) {
        const int count = min(ATT_TILE, end - t0);
        __syncthreads();
        load_tile<KV, E>(s, kc, vc, t0, count, n_kv_heads * d, kvh * d, d, vec, pages);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < ATT_ROWS_PER_WARP; ++j) {
            const int r = j * ATT_WARPS + warp;
            const int i = i0 + r;
            // Query i sees keys up to its own position pos0 + i.
            const int visible = min(count, pos0 + i + 1 - t0);
            if (i < n && visible > 0) row_update<E>(st[j], s, r, visible, scale);
        }
    }

    if (gridDim.z > 1) {
        // m is in the natural domain, as attention_prefill_combine is told.
        const PrefillPart p(part, gridDim.z, n, n_heads, d);
#pragma unroll
        for (int j = 0; j < ATT_ROWS_PER_WARP; ++j) {
            const int i = i0 + j * ATT_WARPS + warp;
            if (i >= n) continue;
            float* o = p.acc(blockIdx.z, i, h);
#pragma unroll
            for (int jj = 0; jj < E; ++jj) {
                const int e = jj * 32 + lane;
                if (e < d) o[e] = st[j].acc[jj];
            }
            if (lane == 0) {
                float* ml = p.ml(blockIdx.z, i, h);
                ml[0] = st[j].m;
                ml[1] = st[j].l;
            }
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < ATT_ROWS_PER_WARP; ++j) {
        const int i = i0 + j * ATT_WARPS + warp;
        if (i >= n) continue;
        const float inv = 1.0f / st[j].l;
        float* o = out + ((size_t)i * n_heads + h) * d;
#pragma unroll
        for (int jj = 0; jj < E; ++jj) {
            const int e = jj * 32 + lane;
            if (e < d) o[e] = st[j].acc[jj] * inv;
        }
    }
}

#define ATTENTION(T, KV, E)                                                                    \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_prefill_##T##_e##E(     \
        const float* q, const KV* kc, const KV* vc, float* out, int n, int pos0, int n_heads,  \
        int n_kv_heads, int d, float scale, int vec, const KvPages pages, int keys_per_split,   \
        float* part) {                                                                         \
        grid_dependency_wait();                                                                \
        attention_prefill<KV, E>(q, kc, vc, out, n, pos0, n_heads, n_kv_heads, d, scale, vec,  \
                                 pages, keys_per_split, part);                                 \
    }
#define ATTENTION_ALL_WIDTHS(T, KV) ATTENTION(T, KV, 2) ATTENTION(T, KV, 4) ATTENTION(T, KV, 8)

ATTENTION_ALL_WIDTHS(f32, float)
ATTENTION_ALL_WIDTHS(bf16, bf16_t)
ATTENTION_ALL_WIDTHS(f16, f16_t)

// The splits of a prompt chunk's attention (either form) merged, split by split in order:
// out = Σ acc_z · w_z / Σ l_z · w_z with w_z = exp(m_z - max m), exp2 when the partials' m is
// in the log2 domain (the tensor-core form). A split that held none of a row's keys has
// m = -inf and weighs 0; the first holds key 0, so the max is finite.
// grid: (n, n_heads); any block size.
extern "C" __global__ void attention_prefill_combine(const float* __restrict__ part,
                                                     float* __restrict__ out, int splits, int n,
                                                     int n_heads, int d, int log2_domain) {
    grid_dependency_wait();
    const PrefillPart p((float*)part, splits, n, n_heads, d);
    const int i = blockIdx.x, h = blockIdx.y;
    float m = NEG_INF;
    for (int z = 0; z < splits; ++z) m = fmaxf(m, p.ml(z, i, h)[0]);
    float l = 0.0f;
    for (int z = 0; z < splits; ++z) {
        const float* ml = p.ml(z, i, h);
        const float w = log2_domain ? exp2f(ml[0] - m) : __expf(ml[0] - m);
        l = fmaf(ml[1], w, l);
    }
    const float inv = 1.0f / l;
    float* o = out + ((size_t)i * n_heads + h) * d;
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float acc = 0.0f;
        for (int z = 0; z < splits; ++z) {
            const float* ml = p.ml(z, i, h);
            const float w = log2_domain ? exp2f(ml[0] - m) : __expf(ml[0] - m);
            acc = fmaf(p.acc(z, i, h)[e], w, acc);
        }
        o[e] = acc * inv;
    }
}

// This step's keys and values (f32, [rows, kv_dim]) into one layer's cache at positions
// pos0.. (pos0 read from `pos0_dev` when set) of the sequence's blocks, converted to the
// cache's type; rows past the positions the block table covers are dropped. One launch for
// both.
template <typename KV>
__device__ __forceinline__ void kv_store(const float* __restrict__ k, const float* __restrict__ v,
                                         KV* __restrict__ kc, KV* __restrict__ vc, int rows,
                                         int kv_dim, int pos0, const int* __restrict__ pos0_dev,
                                         const KvPages& pages) {
    if (pos0_dev) pos0 = *pos0_dev;
    const long long n = (long long)rows * kv_dim;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int row = (int)(i / kv_dim);
        if (pos0 + row >= pages.capacity) break;
        const size_t o = kv_row(pages, pos0 + row, kv_dim) + (size_t)(i - (long long)row * kv_dim);
        kc[o] = from_f32<KV>(k[i]);
        vc[o] = from_f32<KV>(v[i]);
    }
}

#define KV_STORE(T, KV)                                                                        \
    extern "C" __global__ void kv_store_##T(const float* k, const float* v, KV* kc, KV* vc,    \
                                            int rows, int kv_dim, int pos0,                    \
                                            const int* pos0_dev, const KvPages pages) {        \
        grid_dependency_wait();                                                                \
        kv_store<KV>(k, v, kc, vc, rows, kv_dim, pos0, pos0_dev, pages);                       \
    }
KV_STORE(f32, float)
KV_STORE(bf16, bf16_t)
KV_STORE(f16, f16_t)
