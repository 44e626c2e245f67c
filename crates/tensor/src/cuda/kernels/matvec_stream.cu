// Decode products at batch 1 (matvec.cuh's formula and fused forms), compute capability 9.0
// on: the weights stream into shared memory by bulk copies (cp.async.bulk, completion counted
// on an mbarrier), so the bytes in flight depend on neither registers nor occupancy and do not
// stop while a block reduces; and the rows are spread evenly over one persistent block per
// multiprocessor, instead of thousands of short blocks whose last wave leaves most of the
// device idle. A block takes more than half a multiprocessor's shared memory, so no second
// one lands beside it (which would halve both and make the whole launch wait for them).
//
// Each block takes a contiguous range of rows (pairs of rows with swiglu), cut into pieces of
// at most MVS_PIECE_BYTES of one row; a stage is as many consecutive pieces as fit in
// MVS_STAGE_BYTES, and as many stages are in flight as the host left room for beside x. The
// first ones are asked for before grid_dependency_wait(): weights are never written during a
// step, so their reads overlap the end of the kernel before. Then x (times the norm weight)
// is put in shared memory once per block, with the norm's sum of squares. A stage's pieces
// go to groups of warps; each lane takes 16-byte chunks of a piece, and a piece's sum is
// reduced across its warp by shuffles. After every stage the block meets once: thread 0 asks
// for the next stage into the freed buffer, and a thread per row touched adds that row's
// piece sums in piece order, writing each row when its last piece is in, so a row's bits
// never depend on timing.
//
// Status: correct (cuda_ops, golden) but not yet fast, so the host takes it only with
// EMBER_STREAM_MATVEC=1. On the H200 it moved 1.7-1.9 TB/s on 4096-12288-column bf16
// matrices and 1.0 on 1024-column ones, against 2.7-4.1 for the register form (qwen3-8b
// decode 103 tok/s against 180). Pieces of 24 KiB instead of 8 changed nothing; stages of
// 16 KiB (up to 12 of them) instead of 32 fell to 1.1-1.2 TB/s: each stage costs about one
// memory round trip (~1.3 us) whatever is in flight, as if the stages did not overlap. Those
// runs issued fence.proxy.async before each refill, which (the suspect) waits for the copies
// in flight; it is gone since, not yet measured. If that is not it, per-thread cp.async
// copies into the same stages are the alternative.

#define MVS_THREADS 256
#define MVS_WARPS (MVS_THREADS / 32)
// Stages: as many as the host gave room for beside x (matvec.rs), at most MVS_MAX_STAGES.
#define MVS_MAX_STAGES 6
#define MVS_STAGE_BYTES 32768
#define MVS_PIECE_BYTES 8192
// A stage's pieces (short rows make many), and the running row sums a block keeps: rows of
// one stage and the one carried over from the stage before.
#define MVS_MAX_PIECES 32
#define MVS_RING 64

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count)
                 : "memory");
#endif
}

// Arrives on `bar` and adds `bytes` to the transfers its phase waits for.
__device__ __forceinline__ void mbarrier_expect(unsigned long long* bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
                 "r"(bytes)
                 : "memory");
#endif
}

// Waits until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(shared_address(bar)), "r"(parity)
            : "memory");
    }
#endif
}

// `bytes` (a multiple of 16, both ends on 16 bytes) from global to shared memory, counted on
// `bar` when they land.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            shared_address(dst)),
        "l"(src), "r"(bytes), "r"(shared_address(bar))
        : "memory");
#endif
}

// How a launch cuts the rows, the same in every block: pieces of a row, 16-byte chunks of a
// piece, pieces of a stage, warps of a piece; and this block's pieces and stages.
struct StreamPlan {
    int row_chunks, per_row, piece_chunks, per_stage, warps_per_piece, unit;
    int buffers;  // stages in flight
    int p0, p1, stages;

    __device__ __forceinline__ int piece_len(int j) const {
        return min(piece_chunks, row_chunks - j * piece_chunks);
    }
};

// The block's shared state besides the stages and x (dynamic shared memory).
struct StreamShared {
    unsigned long long full[MVS_MAX_STAGES];   // a stage's bytes have landed, by phase
    float part[2][MVS_MAX_PIECES][MVS_WARPS];  // piece sums per warp, by stage parity
    float ring[MVS_RING];                      // running row sums, by row
};

extern __shared__ __align__(128) unsigned char stream_smem[];  // x, then the stages

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

// Stage buffer `s`, after x (cols floats, a multiple of 16 bytes).
__device__ __forceinline__ unsigned char* stage_buffer(const MatvecArgs& a, int s) {
    return stream_smem + (size_t)a.cols * 4 + (size_t)s * MVS_STAGE_BYTES;
}

template <typename W>
__device__ __forceinline__ StreamPlan stream_plan(const MatvecArgs& a) {
    StreamPlan p;
    p.row_chunks = a.cols / Chunk<W>::N;
    p.per_row = (p.row_chunks * 16 + MVS_PIECE_BYTES - 1) / MVS_PIECE_BYTES;
    p.piece_chunks = (p.row_chunks + p.per_row - 1) / p.per_row;
    p.per_stage = min(MVS_MAX_PIECES, max(1, MVS_STAGE_BYTES / (p.piece_chunks * 16)));
    p.warps_per_piece = p.per_stage >= MVS_WARPS ? 1 : MVS_WARPS / p.per_stage;
    // Whole (gate, up) pairs with swiglu.
    p.unit = a.swiglu ? 2 : 1;
    const long long units = a.total_rows / p.unit;
    const int row0 = (int)(units * blockIdx.x / gridDim.x) * p.unit;
    const int row1 = (int)(units * (blockIdx.x + 1) / gridDim.x) * p.unit;
    p.p0 = row0 * p.per_row;
    p.p1 = row1 * p.per_row;
    p.stages = (p.p1 - p.p0 + p.per_stage - 1) / p.per_stage;
    p.buffers = min(MVS_MAX_STAGES, (int)((dynamic_smem_bytes() - a.cols * 4) / MVS_STAGE_BYTES));
    return p;
}

// Thread 0 asks for stage `st` into its buffer.
template <typename W>
__device__ __forceinline__ void stream_issue(const MatvecArgs& a, const StreamPlan& plan,
                                             StreamShared& sh, int st) {
    const int s = st % plan.buffers;
    const int first = plan.p0 + st * plan.per_stage, last = min(first + plan.per_stage, plan.p1);
    unsigned bytes = 0;
    for (int p = first; p < last; ++p) bytes += plan.piece_len(p % plan.per_row) * 16;
    mbarrier_expect(&sh.full[s], bytes);
    unsigned char* buffer = stage_buffer(a, s);
    for (int p = first; p < last; ++p) {
        const int row = p / plan.per_row, j = p - row * plan.per_row;
        int local;
        const int i = matvec_locate(a, row, &local);
        const W* src = (const W*)matvec_out(a, i).w + (size_t)local * a.cols +
                       (size_t)j * plan.piece_chunks * Chunk<W>::N;
        bulk_copy(buffer + (p - first) * plan.piece_chunks * 16, src, plan.piece_len(j) * 16,
                  &sh.full[s]);
    }
}

// Before waiting on the kernel before: the barriers, and the first stages asked for.
template <typename W>
__device__ __forceinline__ void stream_start(const MatvecArgs& a, const StreamPlan& plan,
                                             StreamShared& sh) {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < plan.buffers; ++s) mbarrier_init(&sh.full[s], 1);
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
    for (int st = 0; st < min(plan.stages, plan.buffers); ++st) stream_issue<W>(a, plan, sh, st);
}

template <typename W, bool NORM>
__device__ __forceinline__ void matvec_stream(const MatvecArgs& a, const StreamPlan& plan,
                                              StreamShared& sh) {
    const int N = Chunk<W>::N;  // values per chunk
    const int XS = N / 4;       // float4s of x per chunk
    const int cols = a.cols, row_chunks = plan.row_chunks, per_row = plan.per_row;
    const int per_stage = plan.per_stage, unit = plan.unit;

    // x ∘ g into shared memory, float4 k of chunk c at xs[k · row_chunks + c], so a warp's
    // reads of consecutive chunks are consecutive; the norm's sum of squares on the way.
    float4* xs = (float4*)stream_smem;
    float ss = 0.0f;
    for (int c4 = threadIdx.x; c4 < cols / 4; c4 += MVS_THREADS) {
        float4 v = load_f4(a.x + 4 * c4);
        if (NORM) {
            ss = fmaf(v.x, v.x, ss);
            ss = fmaf(v.y, v.y, ss);
            ss = fmaf(v.z, v.z, ss);
            ss = fmaf(v.w, v.w, ss);
            const float4 g = load_f4(a.norm + 4 * c4);
            v.x *= g.x;
            v.y *= g.y;
            v.z *= g.z;
            v.w *= g.w;
        }
        xs[(c4 % XS) * row_chunks + c4 / XS] = v;
    }
    const float scale = NORM ? 1.0f / sqrtf(block_sum(ss) / (float)cols + a.eps) : 1.0f;
    __syncthreads();  // x is in place (block_sum alone would not order it without the norm)

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = MVS_WARPS / plan.warps_per_piece;
    const int group = warp / plan.warps_per_piece, sub = warp % plan.warps_per_piece;
    const int tg = sub * 32 + lane, width = plan.warps_per_piece * 32;
    for (int st = 0; st < plan.stages; ++st) {
        const int s = st % plan.buffers, parity = st & 1;
        const int first = plan.p0 + st * per_stage, count = min(per_stage, plan.p1 - first);
        mbarrier_wait(&sh.full[s], (st / plan.buffers) & 1);
        const uint4* buffer = (const uint4*)stage_buffer(a, s);
        for (int q = group; q < count; q += groups) {
            const int p = first + q, j = p % per_row;
            const int c0 = j * plan.piece_chunks, len = plan.piece_len(j);
            const uint4* wq = buffer + q * plan.piece_chunks;
            float acc = 0.0f;
#pragma unroll 4
            for (int c = tg; c < len; c += width) {
                float wf[N];
                Chunk<W>::unpack(wq[c], wf);
#pragma unroll
                for (int k = 0; k < XS; ++k) {
                    const float4 xv = xs[k * row_chunks + c0 + c];
                    acc = fmaf(wf[4 * k], xv.x, acc);
                    acc = fmaf(wf[4 * k + 1], xv.y, acc);
                    acc = fmaf(wf[4 * k + 2], xv.z, acc);
                    acc = fmaf(wf[4 * k + 3], xv.w, acc);
                }
            }
            acc = warp_sum(acc);
            if (lane == 0) sh.part[parity][q][sub] = acc;
        }
        __syncthreads();  // the stage is read and its piece sums are in `part`
        // The freed buffer's next copy. No proxy fence first: every read of the buffer has
        // returned (the sums above used them) before the barrier, and a copy only writes it,
        // as in CUTLASS's TMA pipelines (a fence here seemed to wait for the copies in flight).
        if (threadIdx.x == 0 && st + plan.buffers < plan.stages)
            stream_issue<W>(a, plan, sh, st + plan.buffers);
        // A thread per row (pair) the stage touched: its pieces' sums, in order, onto the
        // row's running sum; the row is written once its last piece is in.
        const int last = first + count - 1;
        const int u = first / per_row / unit + threadIdx.x;
        if (u > last / per_row / unit) continue;
        float sums[2] = {0.0f, 0.0f};
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            if (rr >= unit) break;
            const int row = u * unit + rr;
            const int pa = max(first, row * per_row), pb = min(last, row * per_row + per_row - 1);
            // A gate row finished in an earlier stage keeps its sum in the ring.
            float sum = pa == row * per_row ? 0.0f : sh.ring[row % MVS_RING];
            for (int p = pa; p <= pb; ++p)
                for (int w = 0; w < plan.warps_per_piece; ++w) sum += sh.part[parity][p - first][w];
            sh.ring[row % MVS_RING] = sum;
            sums[rr] = sum;
        }
        const int end_row = u * unit + unit - 1;
        if (end_row * per_row + per_row - 1 <= last)
            matvec_store(a, u * unit, sums[0], sums[1], scale, 0);
    }
}

// The first stages are asked for before grid_dependency_wait(): weights are never written
// during a step.
#define MATVEC_STREAM(NAME, W, NORM)                                                            \
    extern "C" __global__ void __launch_bounds__(MVS_THREADS) NAME(const MatvecArgs a) {        \
        __shared__ StreamShared sh;                                                             \
        const StreamPlan plan = stream_plan<W>(a);                                              \
        stream_start<W>(a, plan, sh);                                                           \
        grid_dependency_wait();                                                                 \
        matvec_stream<W, NORM>(a, plan, sh);                                                    \
    }
#define MATVEC_STREAM_BOTH(T, W)                  \
    MATVEC_STREAM(matvec_stream_##T, W, false)    \
    MATVEC_STREAM(matvec_stream_##T##_norm, W, true)

MATVEC_STREAM_BOTH(f32, float)
MATVEC_STREAM_BOTH(bf16, bf16_t)
MATVEC_STREAM_BOTH(f16, f16_t)
