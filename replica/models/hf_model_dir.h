// Hugging Face model directories: what transformers' from_pretrained reads and
// save_pretrained writes, for the Llama family of llama.h.
//
//   config.json                                   the architecture (llama.h: parse_llama_config)
//   model.safetensors                             one weight file, or
//   model.safetensors.index.json                  {"weight_map": {tensor: shard file}} plus
//   model-00001-of-0000N.safetensors ...          the shards it names
//   generation_config.json, tokenizer.json, tokenizer.model, tokenizer_config.json,
//   special_tokens_map.json, ...                  carried along on save
//
// Weights may be stored in bf16, fp16 or fp32; they are converted to the requested parameter
// dtype on load, and written back in the checkpoint's dtype on save. Only safetensors is
// read or written (a directory with only pytorch_model.bin is an error saying so).
#pragma once

#include "replica/io/safetensors.h"
#include "replica/models/llama.h"

#include <optional>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace replica::models {

// DIR/config.json, parsed (replica::Error naming the file for anything unsupported).
LlamaConfig read_hf_config(const std::string& dir);

// The weight files of DIR: {DIR/model.safetensors} when it exists (transformers prefers it),
// else the shards DIR/model.safetensors.index.json names, in order.
std::vector<std::string> hf_weight_files(const std::string& dir);

// Copies DIR's weights into `model` (converting dtype). Every parameter must be found with
// its shape; a tensor matching no parameter is an error naming it and its file (HF's legacy
// rotary_emb.inv_freq buffers and, for tied models, lm_head.weight are skipped). Returns the
// dtype the weights were stored in, and records it as the model's checkpoint_dtype.
// With `quant`, every decoder linear (lora.h: quantizable_linears) is quantized as soon as its
// weight is read (converted to `dtype` first), so the full-precision model is never resident
// at once: QLoRA's load_in_4bit / load_in_8bit. With quant.embeddings, the token embeddings and
// an untied lm_head are quantized too, once loaded.
// `extra`: tensors the directory may hold beside the model's parameters (collected into
// extra->taken instead of refused) and parameters it may lack (left as they are): a reward
// model reads a causal LM's checkpoint (no score head) or a LlamaForSequenceClassification's
// (score.weight, no lm_head).
struct HfExtraTensors {
  std::set<std::string> take;
  std::set<std::string> may_be_missing;
  std::map<std::string, torch::Tensor> taken;
};
torch::ScalarType load_hf_weights(LlamaForCausalLM& model, const std::string& dir, const QuantOptions& quant = {},
                                  HfExtraTensors* extra = nullptr);

// config.json + weights: a model with parameters in `dtype` (fp32 by default), its decoder
// linears quantized when `quant` says so.
LlamaForCausalLM load_hf_model(const std::string& dir, torch::ScalarType dtype = torch::kFloat32,
                               const QuantOptions& quant = {}, HfExtraTensors* extra = nullptr);

// The model's weights under their HF names in `dtype` (default: its checkpoint dtype), on
// CPU, contiguous; for tied models without lm_head.weight. replica::Error if LoRA adapters
// are attached and unmerged (merge_lora first, or save the adapter), or the base is quantized.
io::NamedTensors hf_state_dict(const LlamaForCausalLM& model, std::optional<torch::ScalarType> dtype = std::nullopt);

// Writes an HF model directory OUT: model.safetensors (hf_state_dict; atomic), config.json
// (copied byte for byte from SOURCE when its torch_dtype is the one saved, otherwise the
// model's config with torch_dtype updated), and generation_config.json plus the tokenizer
// files copied from SOURCE when given. OUT is created; OUT must not be SOURCE.
void save_hf_model_dir(const LlamaForCausalLM& model, const std::string& out_dir,
                       const std::string& source_dir = "",
                       std::optional<torch::ScalarType> dtype = std::nullopt);

// `replica merge-adapter`: loads MODEL_DIR (fp32), the PEFT adapter ADAPTER_DIR, folds
// W += scaling * B @ A into the weights, and saves OUT as a plain HF model directory in the
// original weight dtype with MODEL_DIR's config and tokenizer files.
void merge_adapter_dir(const std::string& model_dir, const std::string& adapter_dir, const std::string& out_dir);

// The embedded default model: a small Llama in real HF layout, random init like HF's
// _init_weights (normal(0, 0.02), norms at one), from its own generator seeded `seed` (the
// global RNG is untouched). ~2.9 M parameters in the layers plus vocab_size * 256 for the
// (tied) embeddings. The lead copies the tokenizer files in; vocab_size must be the
// tokenizer's.
struct TinyLlamaOptions {
  int64_t hidden_size = 256;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 8;
  int64_t num_key_value_heads = 4;
  int64_t intermediate_size = 688;
  int64_t max_position_embeddings = 2048;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = true;
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> pad_token_id;
  torch::ScalarType dtype = torch::kFloat32;  // of model.safetensors and torch_dtype
  uint64_t seed = 0;
};
// Writes DIR/config.json, DIR/model.safetensors, DIR/generation_config.json; returns the config.
LlamaConfig make_tiny_llama(const std::string& dir, int64_t vocab_size, const TinyLlamaOptions& options = {});

}  // namespace replica::models
