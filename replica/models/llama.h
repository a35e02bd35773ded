// The Llama family of decoder-only language models, written plainly (in the spirit of
// llm.c) and numerically equal to Hugging Face transformers' eager implementation:
//   model_type llama   Llama 2 / 3.x: RMSNorm, rotary embeddings (with Llama 3's
//                      rope_scaling), grouped-query attention, SwiGLU MLP, tied or untied
//                      embeddings, optional attention_bias (q/k/v/o) and mlp_bias;
//   model_type mistral the same network (sliding_window must be null or cover the sequence);
//   model_type qwen2   adds biases on q/k/v (not o);
//   model_type qwen3   adds RMSNorm over each head of q and k (q_norm / k_norm) and takes
//                      head_dim from the config (it need not be hidden_size / heads).
//
// Parameter names are Hugging Face's, so named_parameters() maps 1:1 onto the keys of
// model.safetensors (tied embeddings: lm_head.weight is not a parameter; the head uses
// model.embed_tokens.weight, and save omits lm_head.weight as save_pretrained does):
//   model.embed_tokens.weight                         [V, H]
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight    (.bias for qwen2 q/k/v, attention_bias)
//   model.layers.N.self_attn.{q,k}_norm.weight        [head_dim] (qwen3)
//   model.layers.N.mlp.{gate,up,down}_proj.weight
//   model.layers.N.input_layernorm.weight, model.layers.N.post_attention_layernorm.weight
//   model.norm.weight, lm_head.weight                 [V, H] (untied)
//
// Compute dtype = parameter dtype (fp32 or bf16; module.to(dtype) converts). Like HF:
// RMSNorm and rotary angles in fp32 then cast to the activation dtype, attention through
// ATen's fused kernel (transformers' sdpa; Note [attention kernel] in llama.cpp), cross-entropy
// in fp32.
#pragma once

#include "replica/models/layer_hooks.h"
#include "replica/models/lora.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace replica::models {

// Llama 3's rope_scaling ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
// "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}).
struct RopeScaling {
  std::string rope_type = "llama3";
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// The fields of config.json the network depends on. Defaults are transformers' LlamaConfig
// defaults for the optional fields; parse_llama_config requires the sizes.
struct LlamaConfig {
  std::string model_type = "llama";          // llama | qwen2 | qwen3 | mistral
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t head_dim = 128;                    // hidden_size / heads unless config.json says
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;   // null / "default" = none
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;                     // qwen2: always; llama/qwen3: attention_bias
  bool o_bias = false;                       // llama/qwen3: attention_bias
  bool mlp_bias = false;                     // llama: mlp_bias
  bool qk_norm = false;                      // qwen3
  double attention_dropout = 0.0;            // on attention probabilities, training only
  std::optional<int64_t> sliding_window;     // set only when it is in effect
  std::string torch_dtype = "float32";       // as written in config.json (or "dtype")
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;        // eos_token_id may be one id or a list
  std::optional<int64_t> pad_token_id;
  double initializer_range = 0.02;
  std::string json_text;                     // config.json as read (rewritten on save)

  int64_t num_key_value_groups() const { return num_attention_heads / num_key_value_heads; }
  // replica::Error naming sliding_window when a sequence of `length` tokens is longer than
  // the window (replica has no sliding-window attention; within the window it is full
  // causal attention, so a window covering the sequence is exact).
  void check_sequence_length(int64_t length) const;
  // config.json text: json_text with the fields above written over it (or a fresh HF-style
  // config when json_text is empty).
  std::string to_json_string() const;
};

// Parses config.json text. `source` (the file) is named in every error: an unsupported
// model_type, hidden_act other than silu, rope_scaling of another type, a missing or
// mistyped field, quantization_config, inconsistent head counts.
LlamaConfig parse_llama_config(const std::string& json_text, const std::string& source);
// Reads and parses a config.json file.
LlamaConfig read_llama_config_file(const std::string& path);
// torch dtype of a config's torch_dtype string ("bfloat16" -> kBFloat16, ...).
torch::ScalarType dtype_from_string(const std::string& name, const std::string& source);
std::string dtype_to_string(torch::ScalarType dtype);

// x * rsqrt(mean(x^2) + eps) in fp32, cast back to x's dtype, times weight.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, torch::ScalarType dtype = torch::kFloat32);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// Token embedding: weight [V, H]; rows looked up by id. The pad row (pad_token_id, when the
// config has one) gets no gradient, like nn.Embedding(padding_idx=pad_token_id) in HF.
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t dim, std::optional<int64_t> padding_idx,
                torch::ScalarType dtype = torch::kFloat32);
  torch::Tensor forward(const torch::Tensor& ids);
  torch::Tensor weight;

 private:
  int64_t padding_idx_ = -1;
};
TORCH_MODULE(Embedding);

// Rotary position embedding tables: cos/sin [B, T, head_dim] for given positions.
class RotaryEmbedding {
 public:
  explicit RotaryEmbedding(const LlamaConfig& config);
  // position_ids [B, T] (integer) -> {cos, sin}, computed in fp32 and cast to `dtype`.
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& position_ids,
                                                  torch::ScalarType dtype);
  const torch::Tensor& inv_freq() const { return inv_freq_; }

 private:
  torch::Tensor inv_freq_;  // [head_dim / 2] fp32; a plain member, not a buffer (like HF's
                            // non-persistent buffer it is never saved nor cast by to(dtype))
};

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& config, torch::ScalarType dtype, bool init);
  // x [B, T, H]; cos/sin [B, T, D]; allowed [B, 1, T, T] bool (true = may attend), or
  // undefined for plain causal attention.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& allowed);
  LoraLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // qwen3 only

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double attention_dropout_;
};
TORCH_MODULE(LlamaAttention);

// SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)).
class LlamaMLPImpl : public torch::nn::Module {
 public:
  LlamaMLPImpl(const LlamaConfig& config, torch::ScalarType dtype, bool init);
  torch::Tensor forward(const torch::Tensor& x);
  LoraLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

// Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).
class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& config, torch::ScalarType dtype, bool init);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& allowed);
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// The decoder stack ("model." in HF names): embeddings, layers, final norm.
class LlamaModelImpl : public torch::nn::Module, public HookedLayers {
 public:
  LlamaModelImpl(const LlamaConfig& config, torch::ScalarType dtype, bool init);
  // Returns the final hidden states [B, T, H] (after model.norm).
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& position_ids,
                        const torch::Tensor& segment_ids);
  // embed_tokens, each decoder layer, norm.
  std::vector<std::shared_ptr<torch::nn::Module>> hooked_layers() override;
  // Activation checkpointing of every decoder layer (models/recompute.h): off by default.
  void set_gradient_checkpointing(bool on) { recompute_layers_ = on; }
  bool gradient_checkpointing() const { return recompute_layers_; }
  Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};

 private:
  LlamaConfig config_;
  RotaryEmbedding rotary_;
  bool recompute_layers_ = false;
};
TORCH_MODULE(LlamaModel);

class LlamaForCausalLMImpl : public torch::nn::Module, public HookedLayers {
 public:
  // Parameters in `dtype`; init = HF's _init_weights (normal(0, initializer_range) for linear
  // and embedding weights, zero biases, ones for norms; the pad row of the embedding zeroed),
  // drawn from the global torch RNG. init false leaves them uninitialised (for loaders).
  explicit LlamaForCausalLMImpl(const LlamaConfig& config, torch::ScalarType dtype = torch::kFloat32,
                                bool init = true);

  // input_ids [B, T] integer token ids.
  // position_ids [B, T] (optional, undefined = 0..T-1, or restarting at 0 in each segment
  //   when segment_ids are given).
  // segment_ids [B, T] (optional): packed samples; a token attends only to earlier tokens
  //   of the same segment (block-diagonal causal mask). Segments must be contiguous runs.
  //   Padding, on either side of a row, is a segment of its own (train/llm_sft.h gives it
  //   -1): no sample's token attends to it, each pad attends to pads (never to nothing), and
  //   positions restart at 0 at the first token after left padding, as transformers'
  //   position_ids from the attention mask do.
  // Returns logits [B, T, V] in the compute dtype.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& position_ids = {},
                        const torch::Tensor& segment_ids = {});

  // The decoder's layers, then lm_head (untied); the tied head reuses embed_tokens.
  std::vector<std::shared_ptr<torch::nn::Module>> hooked_layers() override;
  void set_layer_hooks(LayerHooks* hooks) override;

  const LlamaConfig& config() const { return config_; }
  // The dtype the weights had in the checkpoint they were loaded from (save writes this).
  torch::ScalarType checkpoint_dtype() const { return checkpoint_dtype_; }
  void set_checkpoint_dtype(torch::ScalarType dtype) { checkpoint_dtype_ = dtype; }

  LlamaModel model{nullptr};
  LoraLinear lm_head{nullptr};  // null when tie_word_embeddings

 private:
  LlamaConfig config_;
  torch::ScalarType checkpoint_dtype_ = torch::kFloat32;
};
TORCH_MODULE(LlamaForCausalLM);

// Cross-entropy of next-token prediction, HF's ForCausalLMLoss: logits [B, T, V] at position
// t predict labels[t + 1]; labels == -100 are ignored; computed in fp32. With segment_ids,
// a prediction across a segment boundary (last token of one packed sample -> first token of
// the next) is ignored too.
struct TokenLoss {
  torch::Tensor sum;    // fp32 scalar, summed over counted tokens (differentiable)
  torch::Tensor count;  // int64 scalar, number of counted tokens
};
TokenLoss causal_lm_loss_sum(const torch::Tensor& logits, const torch::Tensor& labels,
                             const torch::Tensor& segment_ids = {});
// sum / count (0 when no token counts, where torch's mean would give NaN).
torch::Tensor causal_lm_loss(const torch::Tensor& logits, const torch::Tensor& labels,
                             const torch::Tensor& segment_ids = {});

// `replica llm --eval`: each sample alone through the model (no packing, no truncation),
// cross-entropy of every predicted token (token t from tokens < t, for t >= 1) in fp32,
// summed over all samples and divided by the number of predicted tokens. loss_mask[i][t] = 0
// drops token t of sample i as a target (e.g. prompt tokens). Eval mode and no grad for the
// call (the module's training flag is restored). replica::Error when a mask's length does
// not match its sample, a token id is out of range, or nothing is predicted.
double mean_token_loss(LlamaForCausalLM& model, const std::vector<std::vector<int32_t>>& samples,
                       const std::vector<std::vector<uint8_t>>* loss_mask = nullptr);

}  // namespace replica::models
