// out[i] = table[tokens[i]] as f32, one block per token. A token past the table writes NaN,
// so a bad id shows in the logits instead of reading out of bounds.

template <typename T>
__device__ __forceinline__ void embedding(const T* __restrict__ table,
                                          const unsigned* __restrict__ tokens,
                                          float* __restrict__ out, int hidden, int vocab) {
    const unsigned token = tokens[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * hidden;
    if (token >= (unsigned)vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const T* row = table + (size_t)token * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = to_f32(row[i]);
}

#define EMBEDDING(NAME, T)                                                                  \
    extern "C" __global__ void NAME(const T* table, const unsigned* tokens, float* out,      \
                                    int hidden, int vocab) {                                 \
        grid_dependency_wait();                                                              \
        embedding<T>(table, tokens, out, hidden, vocab);                                     \
    }
EMBEDDING(embedding_f32, float)
EMBEDDING(embedding_bf16, bf16_t)
EMBEDDING(embedding_f16, f16_t)
