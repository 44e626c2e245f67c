// Dumps llama.cpp's intermediate tensors for one prompt, for op-by-op comparison with ember.
//
// Runs the prompt exactly as scripts/record_llamacpp.py does through llama-cpp-python
// (n_ctx 512, n_batch = n_ubatch = 512, flash attention disabled, f16 KV cache, logits for
// the last prompt token only), then `steps` greedy decode steps. Every graph node the
// scheduler evaluates is written through the eval callback to OUT/<step>/<name>.f32 (f32,
// ggml order: ne0 fastest) with its shape in OUT/<step>/index.txt; the top logits of each step
// are printed. Build and run with scripts/llamacpp_dump/build.sh (see there).
//
// usage: dump MODEL OUT "id,id,..." [steps] [flash_attn 0|1] [kv f16|f32] [threads]

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/stat.h>
#include <vector>

struct Dump {
    std::string dir;
    FILE * index = nullptr;
    std::vector<uint8_t> buf;
};

static bool eval_cb(struct ggml_tensor * t, bool ask, void * user) {
    auto * d = (Dump *) user;
    if (ask) {
        return true;  // every node
    }
    if (!d->index) {
        return true;
    }
    const int64_t n = ggml_nelements(t);
    std::vector<float> out(n);
    const size_t nbytes = ggml_nbytes(t);
    d->buf.resize(nbytes);
    ggml_backend_tensor_get(t, d->buf.data(), 0, nbytes);
    // Gather in logical order (views may be strided).
    int64_t idx = 0;
    bool ok = true;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                    const size_t off = i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
                    const uint8_t * p = d->buf.data() + off;
                    float v;
                    switch (t->type) {
                        case GGML_TYPE_F32: memcpy(&v, p, 4); break;
                        case GGML_TYPE_F16: { ggml_fp16_t h; memcpy(&h, p, 2); v = ggml_fp16_to_fp32(h); break; }
                        case GGML_TYPE_I32: { int32_t x; memcpy(&x, p, 4); v = (float) x; break; }
                        default: ok = false; v = 0; break;
                    }
                    if (!ok) break;
                    out[idx++] = v;
                }
                if (!ok) break;
            }
            if (!ok) break;
        }
        if (!ok) break;
    }
    if (!ok) {
        fprintf(d->index, "%s %s skipped %s\n", t->name, ggml_type_name(t->type), ggml_op_desc(t));
        return true;
    }
    std::string name = t->name;
    for (auto & c : name) {
        if (c == '/' || c == ' ' || c == '(' || c == ')') c = '_';
    }
    // Names repeat (e.g. views); keep the first and number the rest.
    std::string path = d->dir + "/" + name + ".f32";
    for (int k = 1; ; k++) {
        struct stat st;
        if (stat(path.c_str(), &st) != 0) break;
        path = d->dir + "/" + name + "." + std::to_string(k) + ".f32";
    }
    FILE * f = fopen(path.c_str(), "wb");
    fwrite(out.data(), 4, n, f);
    fclose(f);
    fprintf(d->index, "%s %s %s %lld %lld %lld %lld %s\n", path.c_str(), t->name, ggml_type_name(t->type),
            (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3], ggml_op_desc(t));
    return true;
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL OUT ids [steps] [flash_attn 0|1] [kv f16|f32] [threads]\n", argv[0]);
        return 1;
    }
    const char * model_path = argv[1];
    std::string out = argv[2];
    std::vector<llama_token> ids;
    for (char * s = strtok(argv[3], ","); s; s = strtok(nullptr, ",")) ids.push_back(atoi(s));
    const int steps = argc > 4 ? atoi(argv[4]) : 1;
    const bool fa = argc > 5 && atoi(argv[5]) != 0;
    const bool kv32 = argc > 6 && strcmp(argv[6], "f32") == 0;
    const int threads = argc > 7 ? atoi(argv[7]) : 2;

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) return 1;
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    Dump dump;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (kv32) {
        cp.type_k = GGML_TYPE_F32;
        cp.type_v = GGML_TYPE_F32;
    }
    cp.cb_eval = eval_cb;
    cp.cb_eval_user_data = &dump;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;

    mkdir(out.c_str(), 0755);
    std::vector<llama_token> seq = ids;
    int n_past = 0;
    for (int step = 0; step < steps; step++) {
        std::vector<llama_token> batch_ids = step == 0 ? ids : std::vector<llama_token>{seq.back()};
        llama_batch batch = llama_batch_init((int) batch_ids.size(), 0, 1);
        for (size_t i = 0; i < batch_ids.size(); i++) {
            batch.token[i] = batch_ids[i];
            batch.pos[i] = n_past + (int) i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = i + 1 == batch_ids.size();
        }
        batch.n_tokens = (int) batch_ids.size();
        dump.dir = out + "/" + std::to_string(step);
        mkdir(dump.dir.c_str(), 0755);
        dump.index = fopen((dump.dir + "/index.txt").c_str(), "w");
        if (llama_decode(ctx, batch) != 0) return 1;
        fclose(dump.index);
        dump.index = nullptr;
        n_past += batch.n_tokens;
        llama_batch_free(batch);

        const float * logits = llama_get_logits_ith(ctx, -1);
        std::vector<int> order(n_vocab);
        for (int i = 0; i < n_vocab; i++) order[i] = i;
        std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                          [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
        printf("step %d: top1 %d %.5f top2 %d %.5f margin %.5f\n", step, order[0], logits[order[0]], order[1],
               logits[order[1]], logits[order[0]] - logits[order[1]]);
        FILE * f = fopen((dump.dir + "/logits.f32").c_str(), "wb");
        fwrite(logits, 4, n_vocab, f);
        fclose(f);
        seq.push_back(order[0]);
    }
    FILE * f = fopen((out + "/ids.txt").c_str(), "w");
    for (size_t i = 0; i < seq.size(); i++) fprintf(f, "%s%d", i ? "," : "", seq[i]);
    fprintf(f, "\n");
    fclose(f);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
