// Greedy token ids from llama.cpp for a prompt given as token ids (for
// tools/llamacpp/check_goldens.sh): greedy MODEL.gguf N id1,id2,... -> N ids.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 4) { fprintf(stderr, "usage: greedy model.gguf n ids\n"); return 2; }
    int n = atoi(argv[2]);
    std::vector<llama_token> prompt;
    for (char * t = strtok(argv[3], ","); t; t = strtok(nullptr, ",")) prompt.push_back(atoi(t));
    if (!getenv("GREEDY_LOG")) llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    auto mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    auto cp = llama_context_default_params();
    cp.n_ctx = 512; cp.n_batch = 512; cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
    if (getenv("GREEDY_NO_FA")) cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_batch batch = llama_batch_get_one(prompt.data(), prompt.size());
    llama_token tok;
    for (int i = 0; i < n; i++) {
        if (llama_decode(ctx, batch)) { fprintf(stderr, "decode failed\n"); return 1; }
        float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0;
        for (int v = 1; v < nv; v++) if (logits[v] > logits[best]) best = v;
        tok = best;
        printf(i ? ",%d" : "%d", tok);
        batch = llama_batch_get_one(&tok, 1);
    }
    printf("\n");
    return 0;
}
