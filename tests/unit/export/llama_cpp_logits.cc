// Read a GGUF file with llama.cpp itself (libllama), for tests/unit/export/test_gguf_llama_cpp.py.
//
//   llama_cpp_logits MODEL.gguf IDS.txt LOGITS.f32 TEXTS.txt
//
// IDS.txt holds one row of token ids per line; each row is decoded as its own sequence from position 0
// (a fresh KV cache) and the logits of every position are appended to LOGITS.f32 as float32 [tokens, vocab].
// TEXTS.txt holds one JSON-free line of text per line (UTF-8); the ids llama.cpp's tokenizer gives each
// (no BOS/EOS added, special tokens not parsed) are printed to stdout, one line per text.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf IDS.txt LOGITS.f32 TEXTS.txt\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (model == nullptr) {
        fprintf(stderr, "could not load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    std::vector<std::vector<llama_token>> rows;
    std::ifstream ids(argv[2]);
    for (std::string line; std::getline(ids, line);) {
        std::istringstream in(line);
        std::vector<llama_token> row;
        for (llama_token t; in >> t;) row.push_back(t);
        if (!row.empty()) rows.push_back(row);
    }
    FILE * out = fopen(argv[3], "wb");
    for (const auto & row : rows) {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = cp.n_batch = cp.n_ubatch = static_cast<uint32_t>(row.size());
        cp.n_threads = cp.n_threads_batch = 2;
        llama_context * ctx = llama_init_from_model(model, cp);
        llama_batch batch = llama_batch_init(static_cast<int32_t>(row.size()), 0, 1);
        for (size_t i = 0; i < row.size(); ++i) {
            batch.token[i] = row[i];
            batch.pos[i] = static_cast<llama_pos>(i);
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        batch.n_tokens = static_cast<int32_t>(row.size());
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed\n");
            return 1;
        }
        for (size_t i = 0; i < row.size(); ++i) {
            fwrite(llama_get_logits_ith(ctx, static_cast<int32_t>(i)), sizeof(float), n_vocab, out);
        }
        llama_batch_free(batch);
        llama_free(ctx);
    }
    fclose(out);

    std::ifstream texts(argv[4]);
    std::vector<llama_token> toks(4096);
    for (std::string line; std::getline(texts, line);) {
        const int n = llama_tokenize(vocab, line.c_str(), static_cast<int32_t>(line.size()), toks.data(),
                                     static_cast<int32_t>(toks.size()), false, false);
        for (int i = 0; i < n; ++i) printf(i ? " %d" : "%d", toks[i]);
        printf("\n");
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
