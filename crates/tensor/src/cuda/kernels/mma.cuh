// Tensor-core helpers (sm_80 and later), prepended to the modules that multiply on them:
// mma.m16n8k16 with bf16 operands and f32 sums. Fragment layouts (PTX ISA, "matrix fragments
// for mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A (16×16, row-major), 4 registers of two bf16: (row g, cols 2t, 2t+1), (row g+8, same),
//     (row g, cols 2t+8, 2t+9), (row g+8, same);
//   B (16×8, column-major), 2 registers: (rows 2t, 2t+1 of col g), (rows 2t+8, 2t+9 of col g);
//   C (16×8 f32), 4 values: (row g, cols 2t, 2t+1), (row g+8, cols 2t, 2t+1).
// So a row-major matrix whose rows are the n of B (a Linear's weight rows, keys) gives B's
// registers as 32-bit loads along its rows.

// Two floats as bf16x2: `lo` in the low half (the lower column), round to nearest even.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The same with f16: `cvt` saturates nothing, so values past 65504 become infinite.
__device__ __forceinline__ unsigned pack_f16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c += a · b for one m16n8k16 tile (a row-major, b column-major).
__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


// c += a · b with f16 operands.
__device__ __forceinline__ void mma_f16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 16-bit operands the tensor cores take for values stored as KV: a 16-bit type's own, bf16
// for f32 (which is rounded to it).
template <typename KV> struct Mma16;
template <> struct Mma16<bf16_t> {
    static __device__ __forceinline__ unsigned pack(float lo, float hi) { return pack_bf16(lo, hi); }
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        mma_bf16(c, a, b0, b1);
    }
};
template <> struct Mma16<f16_t> {
    static __device__ __forceinline__ unsigned pack(float lo, float hi) { return pack_f16(lo, hi); }
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        mma_f16(c, a, b0, b1);
    }
};
template <> struct Mma16<float> : Mma16<bf16_t> {};

// The shared-memory address PTX takes, of a generic pointer into shared memory.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// Four 8×8 matrices of 16-bit values from shared memory, lane l giving the address of row
// l % 8 of matrix l / 8 (16 contiguous bytes); register i holds matrix i as a fragment (lane
// l: row l / 4, columns 2(l % 4), 2(l % 4) + 1), or with `.trans` its transpose.
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16 bytes from global to shared memory without passing through registers; with `valid`
// false the 16 bytes are zeros and nothing is read (`src` must still be a global address).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The transpose of an 8×8 matrix of 16-bit values held a register a lane as the fragments
// above hold it (lane l: row l / 4, columns 2(l % 4) and 2(l % 4) + 1): lane l gets rows
// 2(l % 4) and 2(l % 4) + 1 of column l / 4.
__device__ __forceinline__ unsigned transpose_8x8(unsigned x) {
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}
