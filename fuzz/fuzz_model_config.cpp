// config.json of the decoder families (replica/models/llama.h read_llama_config_file /
// parse_llama_config, decoder_family.cpp): parsed only, no weights. Sizes are bounded before
// anything is sized from them (Note [config.json bounds]), nesting while parsing (core/json.h).
// A config that loads must also save (to_json_string, what save_hf_model_dir writes) and load
// again to the same architecture.
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/models/llama.h"

namespace {

using replica::models::LlamaConfig;

bool same_architecture(const LlamaConfig& a, const LlamaConfig& b) {
  return a.model_type == b.model_type && a.vocab_size == b.vocab_size && a.hidden_size == b.hidden_size &&
         a.intermediate_size == b.intermediate_size && a.num_hidden_layers == b.num_hidden_layers &&
         a.num_attention_heads == b.num_attention_heads && a.num_key_value_heads == b.num_key_value_heads &&
         a.head_dim == b.head_dim && a.tie_word_embeddings == b.tie_word_embeddings &&
         a.torch_dtype == b.torch_dtype && a.sliding_window == b.sliding_window &&
         a.sliding_layers == b.sliding_layers && a.num_local_experts == b.num_local_experts &&
         a.norm_style == b.norm_style && a.block_layout == b.block_layout && a.qk_norm == b.qk_norm &&
         a.activation == b.activation;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = replica::fuzz::write_file("config.json", data, size);
  LlamaConfig config;
  try {
    config = replica::models::read_llama_config_file(path);
  } catch (const replica::Error& e) {
    replica::fuzz::check_message(e);
    return 0;
  }
  (void)config.attention_scale();
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) (void)config.layer_slides(layer);
  std::string saved;
  try {
    saved = config.to_json_string();
    const LlamaConfig again = replica::models::parse_llama_config(saved, "saved config.json");
    if (!same_architecture(config, again)) {
      std::fprintf(stderr, "the saved config.json loads as another architecture:\n%s\n", saved.c_str());
      __builtin_trap();
    }
  } catch (const replica::Error& e) {
    std::fprintf(stderr, "a config.json that loads cannot be saved and loaded again: %s\n%.2000s\n", e.what(),
                 saved.c_str());
    __builtin_trap();
  }
  return 0;
}
