// Batch-invariant products on the tensor cores (sm_80 and later):
//
//   y[t, r] = Σ_k x[t, k] · W[r, k]        (y[t, r] += … with `accumulate`)
//
// for 16-bit W [n, k] (a HF Linear) and x [m, k] of the same type, f32 sums, y f32 or bf16.
// W may be several matrices sharing x with their rows end to end (q, k and v): then y is as
// many outputs, rows first .. of W going to output i as its columns 0 .. (`SlicedOut`).
//
// Every output element is computed by one sequence of operations whatever m is and whatever
// tile or grid the host picks: the row length is cut into slices of `slice` values (a multiple
// of 32, chosen by the host from n and k only); a slice's sum starts at zero and runs through
// the slice 32 values at a time in order, two m16n8k16 products a step (W's rows as the A
// operand, x's rows as B's columns); the slices' sums are added in slice order to a total that
// starts at zero. A tile's other rows and tokens never enter an element's sums (an mma's
// output element reads only its own row of A and column of B), so a token's result is the same
// bits alone, in a decode batch of 64 or in a prompt chunk of 512.
//
// Two ways to run the slices, same arithmetic: in order inside one block (the total kept in
// registers; for grids that already fill the device), or one block per slice (`_split`, for
// short batches, whose grid would be a few dozen blocks): each writes its slice's sums to
// `partials`, and the last of a tile's blocks to finish (an atomic ticket) adds them up in
// slice order, writes y, and resets the ticket.
//
// A 32-value step is two m16n8k16 products in k order, values 0 .. 15 then 16 .. 31, their
// fragments loaded by ldmatrix from shared memory (each lane's registers as the mma takes
// them: no moves between the load and the product).
//
// Stages of KS steps (32·KS values) of the block's W rows and x rows go to shared memory by
// cp.async, STAGES deep; the weights of the first stages are requested before the kernel waits
// for the one before it (weights are never written during a step). A stage reads 64·KS
// contiguous bytes of each row: runs of 128 or 256 bytes stream from HBM at nearly the rate of
// one long read, runs of 64 at about two thirds of it (measured on an H100). KS changes how
// values reach the registers, never which products are summed in which order: step s of a
// slice is the same two mma instructions over the same values for every KS, tile and grid.
//
// A shared row holds 4·KS pieces of 16 bytes, piece c of row r at c ^ (r % 8): the 8 rows an
// ldmatrix phase reads at one piece fall in 8 distinct 16-byte bank groups.
//
// On Hopper (sm_90a) the TMA tile takes the same k16 products by wgmma instead: each of two
// warpgroups multiplies 64 weight rows by the block's 128 tokens, one m64n128k16 step a 16
// values, both operands read from shared memory by the tensor cores. A wgmma step adds an
// element the bits an m16n8k16 mma.sync adds it (scripts/wgmma_bits.py: every element equal,
// bf16 and f16, N 8 to 256), so the slices and their order are those above, unchanged. Its
// stages are two steps, so a shared row is 128 bytes, its pieces placed as above: exactly the
// layout of wgmma's 128-byte swizzle, which the tensor cores read as it is and the TMA writes.
// (wgmma's layout without swizzle, core matrices padded 144 bytes apart, gave the same bits in
// twice the best mma.sync tile's time on an H200.)

#define SG_STEP 32
// Bytes of one step of a row: 32 16-bit values.
#define SG_ROW_BYTES 64

#define SG_MAX_OUTS 3

// Where W's rows from `first` go: y [m, width], f32 or bf16. Mirrors `OutArgs`.
struct SlicedOut {
    void* y;
    int first;
    int width;
};

// Mirrors `KernelArgs` in sliced_gemm.rs field for field.
struct SlicedGemmArgs {
    const void* w;    // [n, k]
    const void* x;    // [m, k]
    float* partials;  // [slices][m][n]: the split form's slice sums
    unsigned* tickets;  // one per tile (n tile, m tile) of the split form; zero between launches
    SlicedOut out[SG_MAX_OUTS];  // `outs` of them, by rising `first` (out[0].first = 0)
    int outs;
    int m;
    int n;
    int k;
    int slice;   // values a slice, a multiple of SG_STEP
    int slices;  // ceil(k / slice)
    int accumulate;
    int out_bf16;
};
static_assert(sizeof(SlicedGemmArgs) == 112, "KernelArgs in sliced_gemm.rs has 112 bytes");

template <typename T> struct SlicedMma;
template <> struct SlicedMma<bf16_t> {
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        mma_bf16(c, a, b0, b1);
    }
};
template <> struct SlicedMma<f16_t> {
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        mma_f16(c, a, b0, b1);
    }
};

// Byte offset of piece `piece` (16 bytes) of shared row `row`, rows of 4·KS pieces.
template <int KS>
__device__ __forceinline__ int sg_piece_offset(int row, int piece) {
    static_assert(KS >= 2, "rows of at least 8 pieces: the swizzle takes 3 bits");
    return row * (SG_ROW_BYTES * KS) + ((piece ^ (row & 7)) << 4);
}

// A block's place: BM = 16·WM·WARPS_M weight rows by BN = 8·WN·WARPS_N tokens (a warp takes
// WM 16-row tiles by WN 8-token tiles), and the values it sums: all of k, or its slice.
template <int WM, int WN, int WARPS_M, int WARPS_N, int STAGES, int KS, bool SPLIT>
struct SgBlock {
    static constexpr int BM = 16 * WM * WARPS_M, BN = 8 * WN * WARPS_N;
    static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    static constexpr int ROW_BYTES = SG_ROW_BYTES * KS, PIECES = 4 * KS;
    static constexpr int W_BYTES = BM * ROW_BYTES, STAGE_BYTES = (BM + BN) * ROW_BYTES;
    int r0, t0, k_begin, k_end, steps, stages;

    // The block's tile: row tile blockIdx.x, token tile blockIdx.y.
    __device__ __forceinline__ explicit SgBlock(const SlicedGemmArgs& a)
        : SgBlock(a, blockIdx.x, blockIdx.y) {}

    __device__ __forceinline__ SgBlock(const SlicedGemmArgs& a, int row_tile, int token_tile) {
        r0 = row_tile * BM;
        t0 = token_tile * BN;
        k_begin = SPLIT ? blockIdx.z * a.slice : 0;
        k_end = SPLIT ? min(a.k, k_begin + a.slice) : a.k;
        steps = (k_end - k_begin + SG_STEP - 1) / SG_STEP;
        stages = (steps + KS - 1) / KS;
    }

    // Shared address of stage buffer `buf`'s weight rows, and of its token rows.
    __device__ __forceinline__ static unsigned w_buffer(unsigned smem, int buf) {
        return smem + buf * STAGE_BYTES;
    }
    __device__ __forceinline__ static unsigned x_buffer(unsigned smem, int buf) {
        return smem + buf * STAGE_BYTES + W_BYTES;
    }
};

// One thread's share of staging a tile's ROWS rows of an operand ([.., k], 16-bit) into shared
// memory, 16 bytes a piece: piece p = thread + i·THREADS of the ROWS·PIECES is row p / PIECES,
// piece p % PIECES, so a thread keeps one piece of every R-th row (THREADS is a multiple of
// PIECES) and what it needs is worked out once a block; a stage only adds its columns. Pieces
// past `limit` rows or past the block's values read nothing and stage zeros.
template <int ROWS, int THREADS, int KS>
struct SgStager {
    static constexpr int PIECES = 4 * KS, R = THREADS / PIECES, N = (ROWS + R - 1) / R;
    static constexpr int ROW_STRIDE = SG_ROW_BYTES * KS;
    static_assert(THREADS % PIECES == 0 && R % 8 == 0, "a thread's rows share their swizzle");
    static_assert(ROWS % R == 0 || ROWS < R, "a thread stages every R-th row of the tile");
    const unsigned char* first_piece;  // the thread's piece of its first row at the block's first value
    unsigned to;                       // its shared offset in a stage buffer
    unsigned valid_rows;               // bit i: row r + i·R lies inside the matrix
    int c0;                            // the first value of its piece, at stage 0
    bool in_tile;                      // whether the thread stages anything (ROWS < R)

    __device__ __forceinline__ SgStager(const void* src, int first, int limit, int k,
                                        int k_begin) {
        const unsigned t = threadIdx.x, r = t / PIECES, piece = t % PIECES;
        c0 = k_begin + (int)piece * 8;
        first_piece = (const unsigned char*)src + ((size_t)(first + (int)r) * k + c0) * 2;
        // Row r + i·R sits i·R row strides further, its swizzle the same (R a multiple of 8).
        to = sg_piece_offset<KS>((int)r, (int)piece);
        in_tile = ROWS % R == 0 || (int)r < ROWS;
        valid_rows = 0;
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (first + (int)r + i * R < limit) valid_rows |= 1u << i;
    }

    // Stage `s` of `src` into the buffer at shared address `buffer`.
    __device__ __forceinline__ void stage(unsigned buffer, const void* src, int k, int k_end,
                                          int s) const {
        if (!in_tile) return;
        const bool in_k = c0 + s * SG_STEP * KS < k_end;
        const unsigned char* from = first_piece + (size_t)s * (SG_STEP * KS * 2);
        const size_t row_step = (size_t)R * k * 2;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const bool valid = in_k && (valid_rows >> i & 1u);
            cp_async_16(buffer + to + i * R * ROW_STRIDE,
                        valid ? from + i * row_step : (const unsigned char*)src, valid);
        }
    }
};

// 1024 bytes: the period of the 128-byte swizzle, which wgmma reads from absolute addresses.
extern __shared__ __align__(1024) unsigned char sg_smem[];

// The weights of the first AHEAD stages, requested before the kernel waits for the one before it.
template <int WM, int WN, int WARPS_M, int WARPS_N, int STAGES, int KS, bool SPLIT, int AHEAD>
__device__ __forceinline__ void sliced_gemm_weights_ahead(const SlicedGemmArgs& a) {
    using Block = SgBlock<WM, WN, WARPS_M, WARPS_N, STAGES, KS, SPLIT>;
    const Block blk(a);
    const SgStager<Block::BM, Block::THREADS, KS> w(a.w, blk.r0, a.n, a.k, blk.k_begin);
    const unsigned smem = shared_address(sg_smem);
#pragma unroll
    for (int s = 0; s < AHEAD; ++s)
        if (s < blk.stages) w.stage(Block::w_buffer(smem, s), a.w, a.k, blk.k_end, s);
}

// f(i, j, e, token, row) for each element of a lane's tiles inside the output. A function
// template, not a generic lambda: NVRTC 13.0 takes a generic lambda for a host function.
template <int WM, int WN, typename RowOf, typename TokenOf, typename F>
__device__ __forceinline__ void sliced_each_output(const SlicedGemmArgs& a, const RowOf& row_of,
                                                   const TokenOf& token_of, const F& f) {
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < WN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row_of(i, e), tok = token_of(j, e);
                if (row < a.n && tok < a.m) f(i, j, e, tok, row);
            }
}

// y[tok, row] = v, or += v with `accumulate`, in the output that weight row `row` belongs to.
__device__ __forceinline__ void sliced_store(const SlicedGemmArgs& a, int tok, int row, float v) {
    // The output by constant indices: an argument indexed at run time is copied to local
    // memory first, a round trip every thread of every block pays.
    void* y = a.out[0].y;
    int first = 0, width = a.out[0].width;
    if (a.outs > 2 && row >= a.out[2].first) {
        y = a.out[2].y;
        first = a.out[2].first;
        width = a.out[2].width;
    } else if (a.outs > 1 && row >= a.out[1].first) {
        y = a.out[1].y;
        first = a.out[1].first;
        width = a.out[1].width;
    }
    const size_t at = (size_t)tok * width + (row - first);
    if (a.out_bf16) {
        bf16_t* yb = (bf16_t*)y;
        if (a.accumulate) v = to_f32(yb[at]) + v;
        yb[at] = from_f32<bf16_t>(v);
    } else {
        float* yf = (float*)y;
        yf[at] = a.accumulate ? yf[at] + v : v;
    }
}

// A warp's sums out: `total` (the whole row length) where the block ran every slice, else
// `acc` (its slice) to the split form's partials, the tile's last block then adding the slices
// up in order. The warp's tiles start at weight row `row0` and token `tok0`; element e of tile
// (i, j) is weight row (half e / 2) · 8 + g of the 16, token 2t + e % 2 of the 8 (mma.sync's C
// fragment, and each warp's quarter of a wgmma accumulator alike).
template <int WM, int WN, bool SPLIT>
__device__ __forceinline__ void sliced_gemm_finish(const SlicedGemmArgs& a,
                                                   const float (&acc)[WM][WN][4],
                                                   const float (&total)[WM][WN][4], int row0,
                                                   int tok0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    auto row_of = [&](int i, int e) { return row0 + i * 16 + g + (e >> 1) * 8; };
    auto token_of = [&](int j, int e) { return tok0 + j * 8 + 2 * tq + (e & 1); };
    if (!SPLIT) {
        sliced_each_output<WM, WN>(a, row_of, token_of,
                                   [&](int i, int j, int e, int tok, int row) {
                                       sliced_store(a, tok, row, total[i][j][e]);
                                   });
        return;
    }

    // Split: this slice's sums out, then the tile's last block adds the slices in order.
    const size_t plane = (size_t)a.m * a.n;
    sliced_each_output<WM, WN>(a, row_of, token_of, [&](int i, int j, int e, int tok, int row) {
        a.partials[blockIdx.z * plane + (size_t)tok * a.n + row] = acc[i][j][e];
    });
    __threadfence();
    unsigned* ticket = a.tickets + blockIdx.y * gridDim.x + blockIdx.x;
    // Every thread's sums are out before thread 0 takes the ticket (the barrier), and the
    // block learns from the same barrier whether it was the last.
    __syncthreads();
    const bool last =
        __syncthreads_or(threadIdx.x == 0 && atomicAdd(ticket, 1u) == (unsigned)(a.slices - 1));
    if (!last) return;
    __threadfence();  // the other blocks' sums, seen after their tickets
    sliced_each_output<WM, WN>(a, row_of, token_of, [&](int, int, int, int tok, int row) {
        const float* p = a.partials + (size_t)tok * a.n + row;
        float sum = 0.0f;
        for (int z = 0; z < a.slices; ++z) sum += __ldcg(p + z * plane);
        sliced_store(a, tok, row, sum);
    });
    if (threadIdx.x == 0) *ticket = 0;
}

// x (written by the kernel before) for the first AHEAD stages, whose weights are on their way:
// commit group i holds stage i's x, and group 0 also the early stages' weights.
template <typename Block, int AHEAD, typename Stager>
__device__ __forceinline__ void sliced_x_ahead(const SlicedGemmArgs& a, const Block& blk,
                                               const Stager& x_stager, unsigned smem) {
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        if (s < blk.stages) x_stager.stage(Block::x_buffer(smem, s), a.x, a.k, blk.k_end, s);
        cp_async_commit();
    }
}

// Both sums start at zero.
template <int WM, int WN>
__device__ __forceinline__ void sliced_zero(float (&acc)[WM][WN][4], float (&total)[WM][WN][4]) {
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < WN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = total[i][j][e] = 0.0f;
}

// A slice ends: its sum joins the total, the next starts from zero.
template <int WM, int WN>
__device__ __forceinline__ void sliced_slice_done(float (&acc)[WM][WN][4],
                                                  float (&total)[WM][WN][4]) {
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < WN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                total[i][j][e] += acc[i][j][e];
                acc[i][j][e] = 0.0f;
            }
}

template <typename T, int WM, int WN, int WARPS_M, int WARPS_N, int STAGES, int KS, bool SPLIT>
__device__ __forceinline__ void sliced_gemm(const SlicedGemmArgs& a) {
    using Block = SgBlock<WM, WN, WARPS_M, WARPS_N, STAGES, KS, SPLIT>;
    const Block blk(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warp_m = warp % WARPS_M, warp_n = warp / WARPS_M;
    const int steps = blk.steps, stages = blk.stages, steps_per_slice = a.slice / SG_STEP;
    const SgStager<Block::BM, Block::THREADS, KS> w_stager(a.w, blk.r0, a.n, a.k, blk.k_begin);
    const SgStager<Block::BN, Block::THREADS, KS> x_stager(a.x, blk.t0, a.m, a.k, blk.k_begin);
    const unsigned smem = shared_address(sg_smem);

    sliced_x_ahead<Block, STAGES - 1>(a, blk, x_stager, smem);
    float acc[WM][WN][4], total[WM][WN][4];
    sliced_zero(acc, total);

    // One 32-value step of the stage in buffer `buf`: the tile's two m16n8k16 products a
    // 16-row by 8-token piece, in k order.
    auto step = [&](unsigned ws_addr, unsigned xs_addr, int q) {
        // B: token tile j's values 0-7, 8-15, 16-23, 24-31 of the step (matrices 0-3; lane l
        // gives row l % 8 of matrix l / 8): registers 0-1 the first product's, 2-3 the second's.
        unsigned b[WN][4];
#pragma unroll
        for (int j = 0; j < WN; ++j)
            ldmatrix_x4(b[j], xs_addr + sg_piece_offset<KS>((warp_n * WN + j) * 8 + (lane & 7),
                                                            q * 4 + (lane >> 3)));
#pragma unroll
        for (int i = 0; i < WM; ++i) {
            // A: rows 0-7 and 8-15 of the tile by values 0-7 and 8-15 of the half (the
            // fragment's four registers in order), for each half of the step.
            const int row = (warp_m * WM + i) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned a_frag[4];
                ldmatrix_x4(a_frag, ws_addr + sg_piece_offset<KS>(row, q * 4 + h * 2 + (lane >> 4)));
#pragma unroll
                for (int j = 0; j < WN; ++j)
                    SlicedMma<T>::mma(acc[i][j], a_frag, b[j][2 * h], b[j][2 * h + 1]);
            }
        }
    };

    // Stage s sits in buffer s % STAGES (`buf`); the one refilled is the one before it.
    int left_in_slice = steps_per_slice;
    for (int s = 0, buf = 0; s < stages; ++s, buf = buf + 1 == STAGES ? 0 : buf + 1) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage s is in, and every warp is done with the buffer refilled next
        if (s + STAGES - 1 < stages) {
            const int refill = buf == 0 ? STAGES - 1 : buf - 1;
            w_stager.stage(Block::w_buffer(smem, refill), a.w, a.k, blk.k_end, s + STAGES - 1);
            x_stager.stage(Block::x_buffer(smem, refill), a.x, a.k, blk.k_end, s + STAGES - 1);
        }
        cp_async_commit();

        const unsigned ws_addr = Block::w_buffer(smem, buf), xs_addr = Block::x_buffer(smem, buf);
        // A whole stage's steps without a branch between them (so their loads and products
        // interleave); only the block's last stage may hold fewer. Its steps past the block's
        // values (zeros) are never summed, so an element's sums are the same instructions as
        // with one step a stage.
        const int in_stage = min(KS, steps - s * KS);
        if (in_stage == KS) {
#pragma unroll
            for (int q = 0; q < KS; ++q) step(ws_addr, xs_addr, q);
        } else {
#pragma unroll
            for (int q = 0; q < KS; ++q)
                if (q < in_stage) step(ws_addr, xs_addr, q);
        }
        // Slices are whole stages (the host's slice lengths are multiples of 32·KS values),
        // so a slice ends only at a stage's end, or where the values end.
        left_in_slice -= in_stage;
        if (!SPLIT && (left_in_slice == 0 || s + 1 == stages)) {
            left_in_slice = steps_per_slice;
            sliced_slice_done(acc, total);
        }
    }
    cp_async_wait<0>();
    sliced_gemm_finish<WM, WN, SPLIT>(a, acc, total, blk.r0 + warp_m * WM * 16,
                                      blk.t0 + warp_n * WN * 8);
}

// Hopper's warpgroup products: the `a` features of sm_90 (NVRTC's sm_90a), which no other
// architecture runs; elsewhere the TMA tile's kernels trap and the host never picks them.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SG_WGMMA 1

// wgmma's descriptor of k-major rows of 128 bytes in shared memory under the 128-byte
// swizzle (mode 1, bits 62-63): the start, in 16s; the leading offset, unused by that swizzle
// (1); the stride between 8-row groups, 1024 bytes. A k16 step inside the rows starts 32
// bytes on: the swizzle applies to the address as computed, from 1024-byte boundaries.
__device__ __forceinline__ unsigned long long sg_descriptor(unsigned addr) {
    return (unsigned long long)((addr >> 4) & 0x3fff) | 1ull << 16 | (1024ull >> 4) << 32 |
           1ull << 62;
}

// d += A · Bᵀ for A 64 × 16 and B 128 × 16, both k-major in shared memory (descriptors `a`,
// `b`), d a warpgroup's m64n128 f32 accumulator (64 values a thread).
template <typename T> struct SgWgmma;
#define SG_WGMMA_N128(T, TYPE)                                                                     \
    template <> struct SgWgmma<T> {                                                                \
        static __device__ __forceinline__ void n128(float* d, unsigned long long a,                \
                                                    unsigned long long b) {                        \
            asm volatile(                                                                          \
                "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"                                         \
                "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                  \
                "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
                "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"    \
                "}, %64, %65, p, 1, 1, 0, 0; }"                                                    \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),          \
                  "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),        \
                  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),    \
                  "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),    \
                  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),    \
                  "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),    \
                  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),    \
                  "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),    \
                  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),    \
                  "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),    \
                  "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                               \
                : "l"(a), "l"(b), "r"(1));                                                         \
        }                                                                                          \
    };
SG_WGMMA_N128(bf16_t, "bf16")
SG_WGMMA_N128(f16_t, "f16")

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most N of the warpgroup's committed groups of wgmma steps are in flight.
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins the accumulators in place: no read or write of them moves across this point (after a
// wait, nothing reads a value a step in flight has yet to write).
template <int WN>
__device__ __forceinline__ void wgmma_hold(float (&d)[1][WN][4]) {
#pragma unroll
    for (int j = 0; j < WN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[0][j][e])::"memory");
}
#endif

// A tensor map (CUtensorMap, made by the host's cuTensorMapEncodeTiled): a matrix in global
// memory as the tensor memory accelerator (TMA) reads it.
struct __align__(128) SgTensorMap {
    unsigned long long opaque[16];
};

// The TMA tile's argument: maps of W [n, k] and x [m, k] in boxes of 64 values by 128 rows
// (128-byte swizzle), then the others'. Mirrors `TmaKernelArgs` in sliced_gemm.rs.
struct SlicedTmaArgs {
    SgTensorMap w_map;
    SgTensorMap x_map;
    SlicedGemmArgs a;
};
static_assert(sizeof(SlicedTmaArgs) == 384, "TmaKernelArgs in sliced_gemm.rs has 384 bytes");

#ifdef SG_WGMMA
// mbarriers in shared memory (`addr`: its shared address).
__device__ __forceinline__ void mbarrier_init(unsigned addr, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(count) : "memory");
}
// Arrives (release: this thread's accesses before it happen before those after a wait it
// completes).
__device__ __forceinline__ void mbarrier_arrive(unsigned addr) {
    asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" ::"r"(addr)
                 : "memory");
}
// Arrives and expects `bytes` more from asynchronous copies (complete_tx) in this phase.
__device__ __forceinline__ void mbarrier_arrive_expect(unsigned addr, unsigned bytes) {
    asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }"
                 ::"r"(addr), "r"(bytes)
                 : "memory");
}
// Waits (acquire) until the barrier's phase of parity `parity` is complete. A new barrier's
// phase 0 is in progress, so a wait on parity 1 passes at once.
__device__ __forceinline__ void mbarrier_wait(unsigned addr, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(addr), "r"(parity)
            : "memory");
    } while (!done);
}
// The box at values k0.., rows r0.. of `map` into shared memory at `dst` (1024-aligned: the
// swizzle), its bytes counted on the barrier at `bar`. Rows and values past the matrix read
// as zeros (and count).
__device__ __forceinline__ void tma_load_box(unsigned dst, const SgTensorMap* map, int k0, int r0,
                                             unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"((unsigned long long)map), "r"(k0), "r"(r0), "r"(bar)
        : "memory");
}
#endif

#define SG_TMA_PRODUCER_WARPS 1

// The TMA tile: stages filled by the tensor memory accelerator. One thread of a producer
// warp asks for a stage in two instructions (W's 128 rows and x's 128 tokens, 64 values each,
// written by the TMA in the 128-byte swizzle the descriptors read), STAGES buffers deep, while
// two warpgroups only multiply, 64 weight rows each by the 128 tokens (warps 0-7, since a
// warpgroup's first warp is a multiple of 4; the producer is warp 8). They hand buffers over
// by mbarriers: `full[b]` completes when the stage's bytes have landed in b, `empty[b]` when
// each multiplying warp is done with it. A warpgroup keeps one stage's steps in flight while
// it waits for the next.
//
// Measured (H100, qwen3-8b's products at 2,048 tokens): q/o 136 µs, gate/up 421, against
// cuBLASLt's 91 and 266; the tile before it (all 256 threads staging by cp.async, a block
// barrier a stage) took 179 and 577. Two things held this one back at first: ptxas waited
// after every wgmma where the roles' branch looked divergent to it (C7520; 176 µs), and blocks
// in the grid's order read gate/up's 100 MB of weights once per token tile (538 µs). A
// cp.async producer warpgroup (224 µs) and two m64n64 chains a warpgroup (197 µs, while
// serialised) were tried and are not kept. `wait` is the entry point's grid_dependency_wait().
template <typename T, int STAGES, typename Wait>
__device__ __forceinline__ void sliced_gemm_tma(const SlicedTmaArgs& args, Wait wait) {
#ifdef SG_WGMMA
    static_assert(STAGES >= 2, "a stage loading while one is multiplied");
    constexpr int KS = 2, WN = 16, CONSUMER_WARPS = 8;
    const SlicedGemmArgs& a = args.a;
    using Block = SgBlock<1, WN, 8, 1, STAGES, KS, false>;
    // Blocks in launch order take every token tile of a row tile before the next row tile, so
    // that a row tile's weights come from memory once and are read from L2 by the others (in
    // the grid's order, gate/up's 100 MB of weights were read once per token tile: 538 µs at
    // 2,048 tokens, bound by HBM).
    const int launched = blockIdx.x + blockIdx.y * gridDim.x;
    const Block blk(a, launched / gridDim.y, launched % gridDim.y);
    // The warp's index from lane 0, so that the compiler sees it is the same across the warp:
    // otherwise the roles' branch is a divergent path to it, and it serialises every wgmma
    // (ptxas C7520: a wait after each step).
    const int warp = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0), lane = threadIdx.x & 31;
    const int steps = blk.steps, stages = blk.stages, steps_per_slice = a.slice / SG_STEP;
    const unsigned smem = shared_address(sg_smem);
    // The swizzle is of absolute addresses: stages off 1024-byte boundaries would be read in
    // another order than they were written (wrong sums, silently).
    if (smem & 1023u) __trap();
    // The barriers after the stages: full[b] at b · 8, empty[b] at (STAGES + b) · 8.
    const unsigned bars = smem + STAGES * Block::STAGE_BYTES;
    auto full = [&](int b) { return bars + 8 * b; };
    auto empty = [&](int b) { return bars + 8 * (STAGES + b); };
    if (threadIdx.x == 0) {
        for (int b = 0; b < STAGES; ++b) {
            mbarrier_init(full(b), 1);
            mbarrier_init(empty(b), CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // Warps 0-7 multiply (warpgroups must start at a warp a multiple of 4), warp 8 copies.
    if (warp >= CONSUMER_WARPS) {
        if (lane != 0) return;
        // The first buffers' weights before waiting on the kernel before (it never writes
        // them); the activations, its output, after.
        auto ask = [&](int s, bool weights, bool tokens) {
            const int buf = s % STAGES, k0 = blk.k_begin + s * SG_STEP * KS;
            if (weights) {
                mbarrier_arrive_expect(full(buf), Block::STAGE_BYTES);
                tma_load_box(Block::w_buffer(smem, buf), &args.w_map, k0, blk.r0, full(buf));
            }
            if (tokens) tma_load_box(Block::x_buffer(smem, buf), &args.x_map, k0, blk.t0, full(buf));
        };
        for (int s = 0; s < min(STAGES, stages); ++s) ask(s, true, false);
        wait();
        for (int s = 0; s < stages; ++s) {
            if (s >= STAGES) {
                // The multiplying warps are done with stage s - STAGES, its buffer's last.
                mbarrier_wait(empty(s % STAGES), (s / STAGES - 1) & 1);
            }
            ask(s, s >= STAGES, true);
        }
        return;
    }

    wait();  // the finish may read y (accumulate)
    float acc[1][WN][4], total[1][WN][4];
    sliced_zero(acc, total);
    // Warp w is warpgroup w / 4's 16-row quarter w % 4.
    const unsigned w_rows = (warp >> 2) * 64 * Block::ROW_BYTES;
    int left_in_slice = steps_per_slice;
    for (int s = 0; s < stages; ++s) {
        const int buf = s % STAGES;
        mbarrier_wait(full(buf), (s / STAGES) & 1);
        const unsigned ws = Block::w_buffer(smem, buf) + w_rows, xs = Block::x_buffer(smem, buf);
        const int in_stage = min(KS, steps - s * KS);
        wgmma_fence();
#pragma unroll
        for (int q = 0; q < KS; ++q)
            if (q < in_stage)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned at = (2 * q + h) * 32;
                    SgWgmma<T>::n128(&acc[0][0][0], sg_descriptor(ws + at), sg_descriptor(xs + at));
                }
        wgmma_commit();
        wgmma_wait<1>();  // stage s - 1's steps are done: its buffer goes back to the producer
        if (s > 0 && lane == 0) mbarrier_arrive(empty((s - 1) % STAGES));
        left_in_slice -= in_stage;
        if (left_in_slice == 0 || s + 1 == stages) {
            left_in_slice = steps_per_slice;
            wgmma_wait<0>();
            wgmma_hold(acc);
            sliced_slice_done(acc, total);
            wgmma_hold(acc);
        }
    }
    wgmma_wait<0>();
    wgmma_hold(acc);
    sliced_gemm_finish<1, WN, false>(a, acc, total, blk.r0 + warp * 16, blk.t0);
#else
    __trap();
#endif
}

// The tiles the host picks from (`SlicedTile` in sliced_gemm.rs): a name, then WM, WN,
// WARPS_M, WARPS_N, STAGES, KS. Shared memory: STAGES · (BM + BN) · 64 · KS bytes.
#define SLICED_GEMM_KERNEL(tname, T, tile, WM, WN, WARPS_M, WARPS_N, STAGES, KS)                   \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_M * WARPS_N)                           \
        sliced_gemm_##tname##_##tile(const __grid_constant__ SlicedGemmArgs a) {                   \
        sliced_gemm_weights_ahead<WM, WN, WARPS_M, WARPS_N, STAGES, KS, false, STAGES - 1>(a);     \
        grid_dependency_wait();                                                                    \
        sliced_gemm<T, WM, WN, WARPS_M, WARPS_N, STAGES, KS, false>(a);                            \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_M * WARPS_N)                           \
        sliced_gemm_##tname##_##tile##_split(const __grid_constant__ SlicedGemmArgs a) {           \
        sliced_gemm_weights_ahead<WM, WN, WARPS_M, WARPS_N, STAGES, KS, true, STAGES - 1>(a);      \
        grid_dependency_wait();                                                                    \
        sliced_gemm<T, WM, WN, WARPS_M, WARPS_N, STAGES, KS, true>(a);                             \
    }

// The TMA tile (sm_90a): the multiplying warps' shape in the table's columns (two warpgroups
// of 64 rows by 128 tokens), a producer warp beside them; its own argument; no split form.
#define SLICED_GEMM_TMA_KERNEL(tname, T, tile, WM, WN, WARPS_M, WARPS_N, STAGES, KS)               \
    static_assert(WM == 1 && WN == 16 && WARPS_M == 8 && WARPS_N == 1 && KS == 2,                  \
                  "two warpgroups of 64 rows by 128 tokens, stages of 64 values");                 \
    extern "C" __global__ void __launch_bounds__(32 * (8 + SG_TMA_PRODUCER_WARPS), 1)              \
        sliced_gemm_##tname##_##tile(const __grid_constant__ SlicedTmaArgs args) {                 \
        sliced_gemm_tma<T, STAGES>(args, [] { grid_dependency_wait(); });                          \
    }

#define SLICED_GEMM_ALL(tname, T)                                                                  \
    SLICED_GEMM_KERNEL(tname, T, m128n8k2, 1, 1, 8, 1, 4, 2)                                       \
    SLICED_GEMM_KERNEL(tname, T, m64n16k4, 1, 2, 4, 1, 4, 4)                                       \
    SLICED_GEMM_KERNEL(tname, T, m64n32k4, 1, 4, 4, 1, 3, 4)                                       \
    SLICED_GEMM_KERNEL(tname, T, m64n64w8k4, 1, 4, 4, 2, 3, 4)                                     \
    SLICED_GEMM_KERNEL(tname, T, m128n64k2, 2, 4, 4, 2, 4, 2)                                      \
    SLICED_GEMM_KERNEL(tname, T, m128n128k2, 2, 8, 4, 2, 3, 2)                                     \
    SLICED_GEMM_KERNEL(tname, T, m128n128w16k2, 2, 4, 4, 4, 3, 2)                                  \
    SLICED_GEMM_TMA_KERNEL(tname, T, tma128n128k2, 1, 16, 8, 1, 6, 2)

SLICED_GEMM_ALL(bf16, bf16_t)
SLICED_GEMM_ALL(f16, f16_t)
