// Rotary position embedding of rows of heads of d values, in place, for the queries and the
// keys of a step in one launch: q holds n rows of q_heads heads, k n rows of k_heads heads
// (0 for none); row t is at position pos0 + t, pos0 read from `pos0_dev` when it is set (a
// recorded graph's step). cos/sin are [positions, d/2]; a row past the tables is left as it
// is. `pairs` picks the layout: 0 rotates element i with i + d/2 (HF "rotate half"), 1
// rotates 2i with 2i + 1 (GGUF llama).
//
// With a norm weight set, each head is first RMS-normalised and scaled by it (Qwen3's q/k
// norm), so the head is read and written once. One warp per (row, head). The arithmetic is
// the decode kernel's own rotation (`norm_rotate` in attention_decode.cu), step for step.

#define ROPE_THREADS 128

extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
    rope(float* q, const float* __restrict__ q_norm, int q_heads, float* k,
         const float* __restrict__ k_norm, int k_heads, const float* __restrict__ cos_table,
         const float* __restrict__ sin_table, int n, int d, int pos0,
         const int* __restrict__ pos0_dev, int positions, int pairs, float eps) {
    grid_dependency_wait();
    const int lane = threadIdx.x & 31;
    int item = blockIdx.x * (ROPE_THREADS / 32) + (threadIdx.x >> 5);
    float* x = q;
    const float* norm_weight = q_norm;
    int heads = q_heads;
    if (item >= n * q_heads) {
        item -= n * q_heads;
        x = k;
        norm_weight = k_norm;
        heads = k_heads;
        if (item >= n * k_heads) return;
    }
    const int t = item / heads;
    const int pos = (pos0_dev ? *pos0_dev : pos0) + t;
    if (pos >= positions) return;
    const int half = d / 2;
    float* h = x + (size_t)item * d;
    float scale = 1.0f;
    if (norm_weight) {
        // The sum of squares in the decode kernel's order (`norm_rotate` in
        // attention_decode.cu: lane l sums its run of e values from l·e), so a position
        // rotated here, as a prompt row, gets the bits it gets rotated there, decoded.
        const int e = d <= 64 ? 2 : d <= 128 ? 4 : 8;  // `lane_width` in attention/mod.rs
        float ss = 0.0f;
        if (d <= 32 * e) {
            for (int j = 0; j < e; ++j) {
                const int i = lane * e + j;
                if (i < d) ss = fmaf(h[i], h[i], ss);
            }
        } else {
            for (int i = lane; i < d; i += 32) ss = fmaf(h[i], h[i], ss);
        }
        scale = 1.0f / sqrtf(warp_sum(ss) / (float)d + eps);
    }
    const float* c = cos_table + (size_t)pos * half;
    const float* s = sin_table + (size_t)pos * half;
    // Each lane rewrites only the pairs it reads; the shuffle above ordered the norm's reads.
    for (int i = lane; i < half; i += 32) {
        const int a = pairs ? 2 * i : i;
        const int b = pairs ? 2 * i + 1 : i + half;
        float x1 = h[a], x2 = h[b];
        if (norm_weight) {
            x1 = norm_weight[a] * (x1 * scale);
            x2 = norm_weight[b] * (x2 * scale);
        }
        // Contracted explicitly, as `norm_rotate` does: the same bits whatever the compiler
        // would fuse.
        h[a] = fmaf(x1, c[i], -(x2 * s[i]));
        h[b] = fmaf(x2, c[i], x1 * s[i]);
    }
}
