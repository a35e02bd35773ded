// The Llama family of decoder-only language models, written plainly (in the spirit of
// llm.c) and numerically equal to Hugging Face transformers' implementation, one network
// parameterised by the family switches of decoder_family.h:
//   model_type llama   Llama 2 / 3.x: RMSNorm, rotary embeddings (with Llama 3's
//                      rope_scaling), grouped-query attention, SwiGLU MLP, tied or untied
//                      embeddings, optional attention_bias (q/k/v/o) and mlp_bias;
//   model_type mistral the same network with sliding-window attention on every layer;
//   model_type qwen2   adds biases on q/k/v (not o); sliding windows with use_sliding_window;
//   model_type qwen3   adds RMSNorm over each head of q and k (q_norm / k_norm) and takes
//                      head_dim from the config (it need not be hidden_size / heads);
//   model_type olmo2   norms after the attention and MLP outputs (not before), q/k RMSNorm
//                      over the whole projection, rotary in fp32;
//   model_type olmo3   Olmo 2 with sliding-window layers in its layer_types pattern;
//   model_type gemma3_text (and gemma3's text part) (1 + w) RMSNorm before and after each
//                      block, GELU-tanh gated MLP, embeddings scaled by sqrt(hidden), q/k norm,
//                      local sliding-window and global layers with their own rope bases.
//
// Parameter names are Hugging Face's, so named_parameters() maps 1:1 onto the keys of
// model.safetensors (tied embeddings: lm_head.weight is not a parameter; the head uses
// model.embed_tokens.weight, and save omits lm_head.weight as save_pretrained does):
//   model.embed_tokens.weight                         [V, H]
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight    (.bias for qwen2 q/k/v, attention_bias)
//   model.layers.N.self_attn.{q,k}_norm.weight        [head_dim] (qwen3, gemma3), [heads * head_dim] (olmo)
//   model.layers.N.mlp.{gate,up,down}_proj.weight
//   model.layers.N.input_layernorm.weight             (llama, gemma3)
//   model.layers.N.post_attention_layernorm.weight    (every family: before the MLP in llama,
//                                                      after the attention in olmo and gemma3)
//   model.layers.N.{pre,post}_feedforward_layernorm.weight  (gemma3: pre and post; olmo: post)
//   model.norm.weight, lm_head.weight                 [V, H] (untied)
//
// Compute dtype = parameter dtype (fp32 or bf16; module.to(dtype) converts). Like HF:
// RMSNorm and rotary angles in fp32 then cast to the activation dtype, attention through
// ATen's fused kernel (transformers' sdpa; Note [attention kernel] in llama.cpp), cross-entropy
// in fp32.
#pragma once

#include "replica/models/decoder_family.h"
#include "replica/models/layer_hooks.h"
#include "replica/models/lora.h"
#include "replica/models/moe.h"
#include "replica/models/rope_yarn.h"
#include "replica/models/varlen_attention.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace replica::models {

// rope_scaling of the global (full-attention) layers:
//   llama3  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
//            "original_max_position_embeddings": 8192}
//   linear  {"rope_type": "linear", "factor": 8.0} (Gemma 3): inv_freq / factor
//   yarn    {"rope_type": "yarn", "factor": ..., "original_max_position_embeddings", "beta_fast",
//            "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"} (Olmo 3)
// The frequency scaling fields (factor, original_max_position_embeddings and YaRN's own) are
// YarnScaling's (rope_yarn.h), so that a yarn config is handed to yarn_inv_freq as it is.
struct RopeScaling : YarnScaling {
  std::string rope_type = "llama3";
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
};

// The fields of config.json the network depends on. Defaults are transformers' LlamaConfig
// defaults for the optional fields; parse_llama_config requires the sizes.
struct LlamaConfig {
  std::string model_type = "llama";          // decoder_family.h: supported_model_types()
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
  bool qkv_bias = false;                     // qwen2: always; llama/qwen3/olmo/gemma3: attention_bias
  bool o_bias = false;                       // llama/qwen3/olmo/gemma3: attention_bias
  bool mlp_bias = false;                     // llama: mlp_bias
  double attention_dropout = 0.0;            // on attention probabilities, training only
  std::string torch_dtype = "float32";       // as written in config.json (or "dtype")
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;        // eos_token_id may be one id or a list
  std::optional<int64_t> pad_token_id;
  double initializer_range = 0.02;
  std::string json_text;                     // config.json as read (rewritten on save); for a
                                             // gemma3 checkpoint its text model's config

  // The family switches (decoder_family.h), set from model_type; the defaults are Llama's.
  NormStyle norm_style = NormStyle::kWeightAfterCast;
  BlockLayout block_layout = BlockLayout::kPreNorm;
  QkNorm qk_norm = QkNorm::kNone;
  Activation activation = Activation::kSilu;
  bool scale_embeddings = false;             // gemma3: embeddings * sqrt(hidden_size)
  bool rope_in_fp32 = false;                 // olmo: q, k rotated in fp32 and cast back
  std::optional<double> query_pre_attn_scalar;    // gemma3: attention scale scalar^-0.5 (else head_dim^-0.5)
  std::optional<double> final_logit_softcapping;  // gemma3: logits = cap * tanh(logits / cap)
  // Sliding-window attention: set only when some layer slides. A token of a sliding layer
  // attends to itself and the sliding_window - 1 tokens before it (within its packed sample).
  std::optional<int64_t> sliding_window;
  std::vector<bool> sliding_layers;          // which layers slide (size num_hidden_layers), with sliding_window
  // The rotary base of the sliding layers, with plain (default) RoPE: gemma3's
  // rope_local_base_freq, olmo3's rope_theta when the full layers have rope_scaling. Unset:
  // every layer rotates with rope_theta and rope_scaling.
  std::optional<double> local_rope_theta;
  std::string wrapper_model_type;            // "gemma3": the text part of a multimodal checkpoint
  // gpt_oss: every layer's MLP a mixture of experts (models/moe.h: router, experts of
  // intermediate_size each), and a learned sink logit per attention head
  // (models/attention_sinks.h).
  int64_t num_local_experts = 0;             // > 0: the mixture-of-experts MLP
  int64_t num_experts_per_tok = 0;
  bool attention_sinks = false;
  bool mxfp4_experts = false;                // quantization_config mxfp4: experts stored as blocks/scales
  // gpt_oss: the router's load-balancing loss (models/moe.h) times router_aux_loss_coef added
  // to the training loss (transformers' output_router_logits; off in the published configs).
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.9;

  int64_t num_key_value_groups() const { return num_attention_heads / num_key_value_heads; }
  bool layer_slides(int64_t layer) const {
    return sliding_window.has_value() && layer < static_cast<int64_t>(sliding_layers.size()) &&
           sliding_layers[static_cast<size_t>(layer)];
  }
  // The factor on q k^T: query_pre_attn_scalar^-0.5, or head_dim^-0.5.
  double attention_scale() const;
  // config.json text: json_text with the fields above written over it (or a fresh HF-style
  // config when json_text is empty).
  std::string to_json_string() const;
};

// Parses config.json text. `source` (the file) is named in every error: an unsupported
// model_type, an unsupported activation, rope_scaling of another type, a missing or
// mistyped field, quantization_config, inconsistent head counts. A gemma3 config gives its
// text model's (decoder_family.h: text_model_config; wrapper_model_type "gemma3").
LlamaConfig parse_llama_config(const std::string& json_text, const std::string& source);
// Reads and parses a config.json file.
LlamaConfig read_llama_config_file(const std::string& path);
// torch dtype of a config's torch_dtype string ("bfloat16" -> kBFloat16, ...).
torch::ScalarType dtype_from_string(const std::string& name, const std::string& source);
std::string dtype_to_string(torch::ScalarType dtype);

// x^ = x * rsqrt(mean(x^2) + eps) in fp32, then the weight applied as `style` says
// (NormStyle: weight * x^.to(dtype), (weight * x^).to(dtype), or (x^ * (1 + weight)).to(dtype)).
// The weight starts at ones (zeros for kOnePlusWeight).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, torch::ScalarType dtype = torch::kFloat32,
              NormStyle style = NormStyle::kWeightAfterCast);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
  NormStyle style_;
};
TORCH_MODULE(RMSNorm);

// Token embedding: weight [V, H]; rows looked up by id. The pad row (pad_token_id, when the
// config has one) gets no gradient, like nn.Embedding(padding_idx=pad_token_id) in HF. With
// `scale`, the rows are multiplied by it, rounded to the weight's dtype first (Gemma 3's
// Gemma3TextScaledWordEmbedding: sqrt(hidden_size)). The table may be held quantized
// (quantize_base: params.quantize_embeddings), frozen, its looked-up rows dequantized.
class EmbeddingImpl : public torch::nn::Module, public QuantizedWeightHolder {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t dim, std::optional<int64_t> padding_idx,
                torch::ScalarType dtype = torch::kFloat32, std::optional<double> scale = std::nullopt);
  torch::Tensor forward(const torch::Tensor& ids);
  // h W^T: the table as the tied output head (the quantized weight through quantized_linear).
  torch::Tensor as_head(const torch::Tensor& h);

  // As LoraLinear::quantize_base: `weight` is released (no longer a parameter, undefined) and
  // the table held as codes; replica::Error when already quantized or options are none.
  void quantize_base(const QuantOptions& options);
  bool base_quantized() const override { return quantized_.defined(); }
  const QuantizedTensor& quantized_weight() const override { return quantized_; }
  // `weight`, or the quantized table dequantized (a new tensor, no gradient).
  torch::Tensor base_weight() const;
  torch::Device device() const { return quantized_.defined() ? quantized_.device() : weight.device(); }
  // Module::to, and the quantized table moves with the module (as LoraLinear's).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  torch::Tensor weight;  // undefined once quantized

 private:
  int64_t padding_idx_ = -1;
  std::optional<double> scale_;
  QuantizedTensor quantized_;
};
TORCH_MODULE(Embedding);

// Rotary position embedding tables: cos/sin [B, T, head_dim] for given positions.
class RotaryEmbedding {
 public:
  // The global layers' rotary (rope_theta, rope_scaling).
  explicit RotaryEmbedding(const LlamaConfig& config);
  // Plain RoPE on base `theta` (the sliding layers' local rotary, local_rope_theta).
  RotaryEmbedding(const LlamaConfig& config, double theta);
  // position_ids [B, T] (integer) -> {cos, sin}, computed in fp32 (times attention_scaling)
  // and cast to `dtype`.
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& position_ids,
                                                  torch::ScalarType dtype);
  const torch::Tensor& inv_freq() const { return inv_freq_; }
  double attention_scaling() const { return attention_scaling_; }

 private:
  torch::Tensor inv_freq_;  // [head_dim / 2] fp32; a plain member, not a buffer (like HF's
                            // non-persistent buffer it is never saved nor cast by to(dtype))
  double attention_scaling_ = 1.0;  // yarn's attention factor
};

// Which keys each query of a forward's rows may attend to, as the attention layers see it:
// plain causal (the default), or a [B, 1, T, T] bool mask (true = may attend) built on first
// use, so that a forward whose packed layers all take the varlen path (varlen_attention.h) never
// builds it; with packed rows also their layout. Copies share the built mask.
class AttentionRows {
 public:
  AttentionRows() = default;
  // build: makes the mask; packed: the rows' layout (null: not packed, or no layout); sliding:
  // the mask is a sliding window narrower than the row.
  AttentionRows(std::function<torch::Tensor()> build, std::shared_ptr<const PackedLayout> packed, bool sliding);
  bool causal() const { return !build_; }
  const torch::Tensor& mask() const;  // undefined when causal()
  const PackedLayout* packed() const { return packed_.get(); }
  bool sliding() const { return sliding_; }

 private:
  std::function<torch::Tensor()> build_;
  std::shared_ptr<torch::Tensor> mask_;
  std::shared_ptr<const PackedLayout> packed_;
  bool sliding_ = false;
};

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& config, torch::ScalarType dtype, bool init);
  // x [B, T, H]; cos/sin [B, T, D]; rows: causal, or the mask (and packed layout) of the rows.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const AttentionRows& rows);
  LoraLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // qwen3, olmo, gemma3
  torch::Tensor sinks;                       // gpt_oss: [heads]

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double attention_dropout_;
  double scaling_;
  QkNorm qk_norm_;
  bool rope_in_fp32_;
};
TORCH_MODULE(LlamaAttention);

// Gated MLP: down_proj(act(gate_proj(x)) * up_proj(x)), act SiLU (SwiGLU) or GELU-tanh (Gemma 3).
class LlamaMLPImpl : public torch::nn::Module {
 public:
  LlamaMLPImpl(const LlamaConfig& config, torch::ScalarType dtype, bool init);
  torch::Tensor forward(const torch::Tensor& x);
  LoraLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  Activation activation_;
};
TORCH_MODULE(LlamaMLP);

// Residual block with the family's norms (BlockLayout): pre-norm x + attn(norm(x)), then
// h + mlp(norm(h)); post-norm x + norm(attn(x)), then h + norm(mlp(h)); sandwich
// x + norm(attn(norm(x))), then h + norm(mlp(norm(h)). Layer `index` of the config, which says
// whether it is a sliding-window layer.
class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& config, torch::ScalarType dtype, bool init, int64_t index = 0);
  // cos/sin and the mask are the ones for this layer's kind (LlamaModel picks them).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const AttentionRows& rows);
  bool slides() const { return slides_; }
  // The router scores [B T, E] of the last forward (mixture-of-experts layers; else undefined).
  torch::Tensor router_scores() const { return moe.is_empty() ? torch::Tensor() : moe->last_router_scores(); }
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  MoeMlp moe{nullptr};  // gpt_oss: registered as "mlp" in mlp's place
  // Under their HF names; null where the family has no such norm.
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  RMSNorm pre_feedforward_layernorm{nullptr}, post_feedforward_layernorm{nullptr};

 private:
  torch::Tensor feed_forward(const torch::Tensor& x) { return moe.is_empty() ? mlp(x) : moe(x); }

  BlockLayout layout_;
  bool slides_ = false;
};
TORCH_MODULE(LlamaDecoderLayer);

// The decoder stack ("model." in HF names): embeddings, layers, final norm.
class LlamaModelImpl : public torch::nn::Module, public HookedLayers {
 public:
  LlamaModelImpl(const LlamaConfig& config, torch::ScalarType dtype, bool init);
  // Returns the final hidden states [B, T, H] (after model.norm). packed: packed_layout of
  // segment_ids' host copy (varlen_attention.h); when undefined and the varlen path could be
  // taken it is computed from segment_ids (one device-to-host copy where they are on a GPU).
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& position_ids,
                        const torch::Tensor& segment_ids, const PackedLayout& packed = {});
  // embed_tokens, each decoder layer, norm.
  std::vector<std::shared_ptr<torch::nn::Module>> hooked_layers() override;
  // Activation checkpointing of every decoder layer (models/recompute.h): off by default.
  void set_gradient_checkpointing(bool on) { recompute_layers_ = on; }
  bool gradient_checkpointing() const { return recompute_layers_; }
  // Keep every mixture-of-experts layer's router scores of each forward (router_scores()),
  // differentiable also under checkpointing, for the load-balancing loss (a model without
  // experts collects nothing).
  void set_collect_router_scores(bool on) { collect_router_scores_ = on; }
  // The last forward's router scores, one [B T, E] per layer (empty unless collected).
  const std::vector<torch::Tensor>& router_scores() const { return router_scores_; }
  Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};

 private:
  LlamaConfig config_;
  RotaryEmbedding rotary_;
  std::optional<RotaryEmbedding> local_rotary_;  // the sliding layers' (local_rope_theta)
  bool recompute_layers_ = false;
  bool collect_router_scores_ = false;
  std::vector<torch::Tensor> router_scores_;
};
TORCH_MODULE(LlamaModel);

// A sum of per-token losses and how many tokens it counts (causal_lm_loss_sum, loss_sum).
struct TokenLoss {
  torch::Tensor sum;    // fp32 scalar, summed over counted tokens (differentiable)
  torch::Tensor count;  // int64 scalar, number of counted tokens
  // A per-forward term, not a sum over tokens: router_aux_loss_coef x the router's
  // load-balancing loss (gpt_oss with output_router_logits); undefined otherwise. transformers'
  // loss is sum / count + aux.
  torch::Tensor aux;
};

// What a caller established about a micro-batch from its host copy before moving it to the
// device, so that the model asks the device nothing about it (a device-to-host copy is a host
// wait per forward on a GPU). host_batch_facts makes it; an empty one (the default) makes the
// model check and derive these itself.
struct BatchFacts {
  bool ids_checked = false;  // input_ids were checked against vocab_size (check_token_ids)
  PackedLayout packed;       // packed_layout of segment_ids (undefined: no segment ids)
};

// replica::Error "WHAT: token id X is out of range for vocab_size V" unless every id of ids is
// in [0, vocab_size). On CPU ids no wait; on device ids one device-to-host copy.
void check_token_ids(const torch::Tensor& ids, int64_t vocab_size, const std::string& what);

// For workloads, on a batch built on the host and before it is moved to `device`: the ids
// checked (check_token_ids, WHAT names them in the error) and segment_ids' layout (if defined).
BatchFacts host_batch_facts(const torch::Tensor& input_ids, const torch::Tensor& segment_ids, int64_t vocab_size,
                            const torch::Device& device, const std::string& what);

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
  //   of the same segment (block-diagonal causal mask, or on a GPU the varlen kernel: Note
  //   [packed attention] in varlen_attention.cpp). Segments must be contiguous runs.
  //   Padding, on either side of a row, is a segment of its own (tasks/llm_sft/llm_sft.h gives it
  //   -1): no sample's token attends to it, each pad attends to pads (never to nothing), and
  //   positions restart at 0 at the first token after left padding, as transformers'
  //   position_ids from the attention mask do. Sliding-window layers also keep each token to
  //   the last sliding_window tokens of its segment (counted by index, as transformers does).
  // facts: what the caller checked and computed on the host (BatchFacts); without them the
  //   ids are checked here (one device-to-host copy for ids on a GPU).
  // Returns logits [B, T, V] in the compute dtype (softcapped where the config says).
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& position_ids = {},
                        const torch::Tensor& segment_ids = {}, const BatchFacts& facts = {});

  // causal_lm_loss_sum(forward(input_ids, {}, segment_ids), labels, segment_ids) without the
  // [B, T, V] logits where the head is a plain matrix (no LoRA adapter on it, no softcapping;
  // a quantized head is dequantized whole for it, one [V, H] transient): the head and its cross-entropy `chunk_tokens` tokens at a time
  // (chunked_cross_entropy.h; 0: as many as make 32 MiB of fp32 logits, at least 64).
  // Otherwise exactly that expression.
  TokenLoss loss_sum(const torch::Tensor& input_ids, const torch::Tensor& labels,
                     const torch::Tensor& segment_ids = {}, int64_t chunk_tokens = 0, const BatchFacts& facts = {});

  // The decoder's layers, then lm_head (untied); the tied head reuses embed_tokens.
  std::vector<std::shared_ptr<torch::nn::Module>> hooked_layers() override;

  // Holds the token embeddings and an untied lm_head quantized (`options`; the decoder's
  // linears are models/lora.h's quantize_base_linears). Frozen from then on: with LoRA only.
  // Those not yet quantized are; returns how many were.
  int quantize_embeddings(const QuantOptions& options);
  void set_layer_hooks(LayerHooks* hooks) override;

  const LlamaConfig& config() const { return config_; }
  // The router's load-balancing loss in training (transformers' output_router_logits with
  // router_aux_loss_coef = coef; coef 0: off). Refused for a model without experts unless 0.
  void set_router_aux_loss(double coef);
  // router_aux_loss_coef x load_balancing_loss (moe.h) over the last forward's router scores,
  // counting the tokens where token_mask [B, T] is true (undefined: every token); undefined
  // when output_router_logits is off.
  torch::Tensor router_aux_loss(const torch::Tensor& token_mask = {}) const;
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
TokenLoss causal_lm_loss_sum(const torch::Tensor& logits, const torch::Tensor& labels,
                             const torch::Tensor& segment_ids = {});
// The targets that loss scores position t against: labels[t + 1], -100 for the last position
// and across segment boundaries. [B, T] int64.
torch::Tensor causal_lm_targets(const torch::Tensor& labels, const torch::Tensor& segment_ids = {});
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
