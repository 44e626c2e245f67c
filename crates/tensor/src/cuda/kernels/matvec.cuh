// What the decode products share (prepended to matvec.cu and matvec_stream.cu): the one
// argument struct, where a row of a fused product lives, and how a finished row is stored.
//
//   y_i[b, r] = s_b · (W_i[r] · (x[b] ∘ g)) + bias_i[r]      (+ y_i[b, r] with `accumulate`)
//
// for up to three matrices W_i sharing the input x, their rows laid end to end (q, k and v),
// or with `swiglu` two (gate and up) interleaved, gate r then up r, and y_0 = silu(gate) · up.
// With `norm`, g is that RMS norm weight and s_b = 1 / rms(x[b]); else g = 1 and s_b = 1.

#define MATVEC_MAX_OUTPUTS 3

// One matrix of a fused product and where its rows go.
struct MatvecOut {
    const void* w;      // [rows, cols]
    const float* bias;  // [rows] or null
    float* y;           // [B, rows]
    int rows;
    int pad;
};

// Mirrors `MatvecArgs` in matvec.rs field for field.
struct MatvecArgs {
    MatvecOut out[MATVEC_MAX_OUTPUTS];
    const float* x;     // [B, cols]
    const float* norm;  // [cols] or null
    float eps;
    int outputs;
    int total_rows;  // rows of all outputs (twice the rows of one with swiglu)
    int cols;
    int accumulate;
    int swiglu;
    int vec;  // every row and x start on 16 bytes and cols is a whole number of chunks
    int wpr;
    // The `_experts` kernels only:
    const int* tiles;  // [1 + 3·tiles]: the tile count, then (expert, first, pairs) per tile
    const int* order;  // pair indices grouped by expert; a tile's are order[first..first + pairs]
    const unsigned long long* experts;  // [experts][outputs] weight addresses (out[i].w unused)
    int x_div;         // pair p reads x row p / x_div
    int prefetch_blocks;  // blocks that may start before the kernel before ends (matvec_prefetch)
};
static_assert(sizeof(MatvecArgs) == 176, "KernelArgs in matvec.rs has 176 bytes");

__device__ __forceinline__ MatvecOut matvec_out(const MatvecArgs& a, int i) {
    return i == 0 ? a.out[0] : (i == 1 ? a.out[1] : a.out[2]);
}

// The output a row of the fused product belongs to, and the row's index there.
__device__ __forceinline__ int matvec_locate(const MatvecArgs& a, int row, int* local) {
    if (a.swiglu) {
        *local = row >> 1;
        return row & 1;
    }
    int i = 0;
    if (a.outputs > 1 && row >= a.out[0].rows) {
        row -= a.out[0].rows;
        i = 1;
        if (a.outputs > 2 && row >= a.out[1].rows) {
            row -= a.out[1].rows;
            i = 2;
        }
    }
    *local = row;
    return i;
}

// Finishes a row of the product for batch row `yb`: the norm's `scale`, the bias, then the
// epilogue. With swiglu, `row` is a gate row, `sum` its sum and `up` the sum of its up row.
__device__ __forceinline__ void matvec_store(const MatvecArgs& a, int row, float sum, float up,
                                             float scale, size_t yb) {
    if (a.swiglu) {
        const int r = row >> 1;
        float gate = sum * scale;
        up *= scale;
        if (a.out[0].bias) gate += a.out[0].bias[r];
        if (a.out[1].bias) up += a.out[1].bias[r];
        float* out = a.out[0].y + yb * a.out[0].rows + r;
        const float v = silu(gate) * up;
        *out = a.accumulate ? *out + v : v;
        return;
    }
    int local;
    const MatvecOut o = matvec_out(a, matvec_locate(a, row, &local));
    float v = sum * scale;
    if (o.bias) v += o.bias[local];
    float* out = o.y + yb * o.rows + local;
    *out = a.accumulate ? *out + v : v;
}
