// The last position's logits of a prompt of token ids, computed by llama.cpp: moepack's second reference.
// Build against a llama.cpp build (benchmarks/llama_cpp.sh):
//   c++ -O2 -std=c++17 llama_logits.cpp -I SRC/include -I SRC/ggml/include -L BUILD/bin -lllama -lggml \
//       -Wl,-rpath,BUILD/bin -o llama-logits
// Usage: llama-logits MODEL.gguf IDS.txt OUT.f32 [threads]   (IDS.txt: whitespace-separated ids; OUT: raw float32)
// The KV cache is F32 and flash attention off, so the result is llama.cpp's float32 arithmetic throughout.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL.gguf IDS.txt OUT.f32 [threads]\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> ids;
    FILE * f = std::fopen(argv[2], "r");
    if (!f) { std::fprintf(stderr, "cannot read %s\n", argv[2]); return 1; }
    int id;
    while (std::fscanf(f, "%d", &id) == 1) ids.push_back(id);
    std::fclose(f);
    if (ids.empty()) { std::fprintf(stderr, "no token ids in %s\n", argv[2]); return 1; }

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { std::fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = ids.size() + 16;
    cp.n_batch = cp.n_ubatch = ids.size();
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (argc > 4) cp.n_threads = cp.n_threads_batch = std::atoi(argv[4]);
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { std::fprintf(stderr, "cannot make a context\n"); return 1; }
    if (llama_decode(ctx, llama_batch_get_one(ids.data(), (int32_t) ids.size())) != 0) {
        std::fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const float * logits = llama_get_logits_ith(ctx, -1);
    FILE * out = std::fopen(argv[3], "wb");
    if (!out || std::fwrite(logits, sizeof(float), n_vocab, out) != (size_t) n_vocab) {
        std::fprintf(stderr, "cannot write %s\n", argv[3]);
        return 1;
    }
    std::fclose(out);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
