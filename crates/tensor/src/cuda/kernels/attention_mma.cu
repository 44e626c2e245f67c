// Causal attention of a prompt chunk on the tensor cores (sm_80 and later): FlashAttention-2's
// forward pass with bf16 operands and f32 accumulation, for heads of D = 64 or 128 values.
//
// Layouts as in attention.cu: queries and outputs [n, n_heads, D] f32, the cache of one layer
// [positions, n_kv_heads, D] (f32, bf16 or f16); query i is at position pos0 + i and sees
// keys 0..=pos0 + i; query head h reads kv head h / (n_heads / n_kv_heads).
//
// A block of 4 warps takes 64 queries of one head, a warp 16 of them, whose bf16 fragments it
// keeps in registers for the whole pass. Keys and values come in tiles of 64, converted to
// bf16 into shared memory (the values transposed, so both products read 32-bit pairs along
// their reduction dimension). Per tile each warp computes its 16×64 scores with
// mma.m16n8k16, masks the diagonal, updates the running max and sum in the log2 domain
// (online softmax), and feeds the probabilities straight from the score registers into the
// P·V product (an accumulator fragment of m16n8 is laid out as the operand fragment of
// m16k16 needs). Rows past the last query are computed on clamped inputs and not written.

#define MMA_ROWS 64
#define MMA_KEYS 64
#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * 32)
// Padding of a shared row in bf16 values: 16 bytes, so the 8 rows a fragment load touches
// start in 8 different bank quads.
#define MMA_PAD 8

// Four consecutive cache values as floats (16-byte aligned for f32, 8 for 16-bit types).
template <typename KV> struct Load4;
template <> struct Load4<float> {
    static __device__ __forceinline__ float4 at(const float* p) { return *(const float4*)p; }
};
template <> struct Load4<bf16_t> {
    static __device__ __forceinline__ float4 at(const bf16_t* p) {
        const uint2 v = *(const uint2*)p;
        return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                           __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
    }
};
template <> struct Load4<f16_t> {
    static __device__ __forceinline__ float4 at(const f16_t* p) {
        const uint2 v = *(const uint2*)p;
        f16_t a, b, c, d;
        a.bits = (unsigned short)(v.x & 0xffffu);
        b.bits = (unsigned short)(v.x >> 16);
        c.bits = (unsigned short)(v.y & 0xffffu);
        d.bits = (unsigned short)(v.y >> 16);
        return make_float4(to_f32(a), to_f32(b), to_f32(c), to_f32(d));
    }
};

// grid: (ceil(n / 64), n_heads); MMA_THREADS threads.
template <typename KV, int D>
__device__ __forceinline__ void attention_prefill_mma(const float* __restrict__ q,
                                                      const KV* __restrict__ kc,
                                                      const KV* __restrict__ vc,
                                                      float* __restrict__ out, int n, int pos0,
                                                      int n_heads, int n_kv_heads, float scale) {
    __shared__ __align__(16) unsigned short ks[MMA_KEYS][D + MMA_PAD];  // keys, bf16
    __shared__ __align__(16) unsigned short vt[D][MMA_KEYS + MMA_PAD];  // values transposed
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;  // the fragment's row group and pair
    const int h = blockIdx.y, kvh = h / (n_heads / n_kv_heads);
    const int q0 = blockIdx.x * MMA_ROWS, w0 = q0 + warp * 16;
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
            qa[k][0] = pack_bf16(r0[c], r0[c + 1]);
            qa[k][1] = pack_bf16(r8[c], r8[c + 1]);
            qa[k][2] = pack_bf16(r0[c + 8], r0[c + 9]);
            qa[k][3] = pack_bf16(r8[c + 8], r8[c + 9]);
        }
    }
    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // Rows g and g + 8 of the warp: running max (log2 domain) and sum.
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    // Positions of those rows: they see keys up to and including these.
    const int p_row[2] = {pos0 + w0 + g, pos0 + w0 + g + 8};

    const int keys = pos0 + min(n, q0 + MMA_ROWS);  // the block's last query sees these
    for (int t0 = 0; t0 < keys; t0 += MMA_KEYS) {
        __syncthreads();  // the previous tile is no longer read
        // 64 keys × D values, 4 at a time; keys past `keys` are zero (and masked below).
        for (int idx = threadIdx.x; idx < MMA_KEYS * D / 4; idx += MMA_THREADS) {
            const int j = idx / (D / 4), e = (idx % (D / 4)) * 4;
            float4 kv4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv4 = kv4;
            if (t0 + j < keys) {
                const size_t off = (size_t)(t0 + j) * kv_stride + kvh * D + e;
                kv4 = Load4<KV>::at(kc + off);
                vv4 = Load4<KV>::at(vc + off);
            }
            *(uint2*)&ks[j][e] = make_uint2(pack_bf16(kv4.x, kv4.y), pack_bf16(kv4.z, kv4.w));
            const unsigned v01 = pack_bf16(vv4.x, vv4.y), v23 = pack_bf16(vv4.z, vv4.w);
            vt[e][j] = (unsigned short)(v01 & 0xffffu);
            vt[e + 1][j] = (unsigned short)(v01 >> 16);
            vt[e + 2][j] = (unsigned short)(v23 & 0xffffu);
            vt[e + 3][j] = (unsigned short)(v23 >> 16);
        }
        __syncthreads();
        // A warp whose first row sees none of this tile has nothing to add.
        if (t0 > pos0 + min(w0 + 15, n - 1)) continue;

        // Scores: 16 rows × 64 keys, as 8 accumulator tiles of 16×8.
        float s[MMA_KEYS / 8][4];
#pragma unroll
        for (int j = 0; j < MMA_KEYS / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int k = 0; k < D / 16; ++k) {
                const unsigned short* kr = &ks[j * 8 + g][k * 16 + 2 * t];
                mma_bf16(s[j], qa[k], *(const unsigned*)kr, *(const unsigned*)(kr + 8));
            }
        }
        // Mask, scale, and the tile's row maxima (over the 4 lanes sharing a row).
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int j = 0; j < MMA_KEYS / 8; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = i >> 1, key = t0 + j * 8 + 2 * t + (i & 1);
                const float v = key <= p_row[r] && key < keys ? s[j][i] * scale_log2 : NEG_INF;
                s[j][i] = v;
                tile_max[r] = fmaxf(tile_max[r], v);
            }
        float correction[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(FULL_MASK, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(FULL_MASK, tile_max[r], 2));
            const float m_new = fmaxf(m[r], tile_max[r]);
            // A row that sees no key of this tile keeps its state (m_new may still be -inf
            // only for rows not yet past any key, which never happens: key 0 is always seen).
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
            const unsigned pa[4] = {pack_bf16(s[2 * k][0], s[2 * k][1]),
                                    pack_bf16(s[2 * k][2], s[2 * k][3]),
                                    pack_bf16(s[2 * k + 1][0], s[2 * k + 1][1]),
                                    pack_bf16(s[2 * k + 1][2], s[2 * k + 1][3])};
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                const unsigned short* vr = &vt[j * 8 + g][k * 16 + 2 * t];
                mma_bf16(o[j], pa, *(const unsigned*)vr, *(const unsigned*)(vr + 8));
            }
        }
    }

    // Rows g and g + 8, columns 2t and 2t + 1 of each 8-wide tile.
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
        int n_kv_heads, float scale) {                                                         \
        grid_dependency_wait();                                                                \
        attention_prefill_mma<KV, D>(q, kc, vc, out, n, pos0, n_heads, n_kv_heads, scale);     \
    }
#define ATTENTION_MMA_ALL_DIMS(T, KV) ATTENTION_MMA(T, KV, 64) ATTENTION_MMA(T, KV, 128)

ATTENTION_MMA_ALL_DIMS(f32, float)
ATTENTION_MMA_ALL_DIMS(bf16, bf16_t)
ATTENTION_MMA_ALL_DIMS(f16, f16_t)
