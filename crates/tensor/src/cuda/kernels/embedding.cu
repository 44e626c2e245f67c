// out[i] = table[tokens[i] - first] as f32, one block per token. The table holds rows
// first..first + vocab of the vocabulary: the whole of it (first = 0), or a tensor-parallel
// rank's part. A token outside the part writes zeros on a rank (`zero_outside`: another rank
// gives its row, summed in) and NaN on a whole table, so a bad id shows in the logits instead
// of reading out of bounds.

template <typename T>
__device__ __forceinline__ void embedding(const T* __restrict__ table,
                                          const unsigned* __restrict__ tokens,
                                          float* __restrict__ out, int hidden, int vocab,
                                          unsigned first, int zero_outside) {
    const unsigned row_index = tokens[blockIdx.x] - first;  // wraps past vocab when below
    float* o = out + (size_t)blockIdx.x * hidden;
    if (row_index >= (unsigned)vocab) {
        const float fill = zero_outside ? 0.0f : __int_as_float(0x7fc00000);
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = fill;
        return;
    }
    const T* row = table + (size_t)row_index * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = to_f32(row[i]);
}

#define EMBEDDING(NAME, T)                                                                  \
    extern "C" __global__ void NAME(const T* table, const unsigned* tokens, float* out,      \
                                    int hidden, int vocab, unsigned first,                   \
                                    int zero_outside) {                                      \
        grid_dependency_wait();                                                              \
        embedding<T>(table, tokens, out, hidden, vocab, first, zero_outside);                \
    }
EMBEDDING(embedding_f32, float)
EMBEDDING(embedding_bf16, bf16_t)
EMBEDDING(embedding_f16, f16_t)
