// The Llama family, layer by layer. Every step follows Hugging Face transformers' code
// (modeling_llama.py, modeling_qwen2.py, modeling_qwen3.py, modeling_mistral.py,
// modeling_olmo2.py, modeling_olmo3.py, modeling_gemma3.py) so that the same weights give the
// same numbers; comments name the HF function mirrored. What differs between the families is
// the switches of decoder_family.h.
#include "replica/models/llama.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/models/attention_sinks.h"
#include "replica/models/chunked_cross_entropy.h"
#include "replica/models/config_json.h"
#include "replica/models/fused_ops.h"
#include "replica/models/linear.h"
#include "replica/models/recompute.h"
#include "replica/models/rope_yarn.h"

#include <ATen/SDPBackend.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <set>
#include <sstream>

namespace replica::models {
namespace {

using json = nlohmann::json;

using namespace config_json;

std::optional<int64_t> optional_token_id(const json& j, const char* key, const std::string& src) {
  const json* v = field(j, key);
  if (!v) return std::nullopt;
  return as_int(*v, key, src);
}

// rope_scaling / rope_parameters: {"rope_type" (or "type"): "llama3" | "linear" | "yarn", ...}.
std::optional<RopeScaling> parse_rope_scaling(const json& r, const char* key, const std::string& src,
                                              int64_t max_position_embeddings) {
  if (!r.is_object()) fail("{}: {} must be an object or null, got {}", src, key, json_excerpt(r));
  auto type = optional_string(r, "rope_type", src);
  if (!type) type = optional_string(r, "type", src);
  if (!type || *type == "default") return std::nullopt;
  if (*type != "llama3" && *type != "linear" && *type != "yarn") {
    fail("{}: {} type {} is not supported (supported: llama3, linear, yarn, default)", src, key,
         quote_excerpt(*type));
  }
  RopeScaling s;
  s.rope_type = *type;
  if (!field(r, "factor")) fail("{}: {} of type {} needs factor", src, key, *type);
  s.factor = as_number(r["factor"], "rope_scaling.factor", src);
  if (s.factor <= 0) fail("{}: {}.factor must be positive, got {}", src, key, s.factor);
  if (*type == "linear") return s;
  if (*type == "yarn") {
    // _compute_yarn_parameters: original_max_position_embeddings falls back to the model's.
    s.original_max_position_embeddings =
        optional_int(r, "original_max_position_embeddings", src, max_position_embeddings, 1, kMaxPositions);
    s.attention_factor = optional_number(r, "attention_factor", src);
    s.beta_fast = optional_number(r, "beta_fast", src, 32.0);
    s.beta_slow = optional_number(r, "beta_slow", src, 1.0);
    s.mscale = optional_number(r, "mscale", src);
    s.mscale_all_dim = optional_number(r, "mscale_all_dim", src);
    s.truncate = optional_bool(r, "truncate", src, true);
    if (s.original_max_position_embeddings < 1) {
      fail("{}: {}.original_max_position_embeddings must be at least 1", src, key);
    }
    return s;
  }
  for (const char* name : {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
    if (!field(r, name)) fail("{}: {} of type llama3 needs {}", src, key, name);
  }
  s.low_freq_factor = as_number(r["low_freq_factor"], "rope_scaling.low_freq_factor", src);
  s.high_freq_factor = as_number(r["high_freq_factor"], "rope_scaling.high_freq_factor", src);
  s.original_max_position_embeddings = as_int(r["original_max_position_embeddings"],
                                              "rope_scaling.original_max_position_embeddings", src, 1, kMaxPositions);
  if (!(s.high_freq_factor > s.low_freq_factor) || s.low_freq_factor <= 0) {
    fail("{}: {} needs 0 < low_freq_factor < high_freq_factor, got {} and {}", src, key,
         s.low_freq_factor, s.high_freq_factor);
  }
  if (s.original_max_position_embeddings < 1) {
    fail("{}: {}.original_max_position_embeddings must be at least 1", src, key);
  }
  return s;
}

// HF's rotate_half: split the last dimension in two halves (x1, x2) -> (-x2, x1).
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  auto x1 = x.narrow(-1, 0, half);
  auto x2 = x.narrow(-1, half, half);
  return torch::cat({-x2, x1}, -1);
}

// HF's apply_rotary_pos_emb for one tensor [B, heads, T, D]; cos/sin [B, T, D].
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto c = cos.unsqueeze(1);
  auto s = sin.unsqueeze(1);
  return (x * c) + (rotate_half(x) * s);
}

}  // namespace

// Note [token ids checked on the host]
// An id outside [0, vocab_size) reaching the embedding is a device-side assert on a GPU (the
// CUDA context is lost, and the message names no input), so the ids are checked first. The check
// needs their bounds on the host: for ids on a GPU a device-to-host copy, which waits for every
// kernel queued before it, once per forward. The workloads build their batches on the host, so
// they check there before the copy to the device (host_batch_facts) and tell the model
// (BatchFacts::ids_checked); a caller who says nothing keeps the model's own check.
void check_token_ids(const torch::Tensor& ids, int64_t vocab_size, const std::string& what) {
  if (ids.numel() == 0) return;
  // Both bounds in one transfer: one wait for the device where the ids are on a GPU.
  const auto [min, max] = torch::aminmax(ids);
  const auto bounds = torch::stack({min, max}).to(torch::kCPU, torch::kInt64);
  const int64_t lo = bounds[0].item<int64_t>();
  const int64_t hi = bounds[1].item<int64_t>();
  if (lo < 0 || hi >= vocab_size) {
    fail("{}: token id {} is out of range for vocab_size {}", what, lo < 0 ? lo : hi, vocab_size);
  }
}

BatchFacts host_batch_facts(const torch::Tensor& input_ids, const torch::Tensor& segment_ids, int64_t vocab_size,
                            const torch::Device& device, const std::string& what) {
  if (!input_ids.is_cpu()) fail("host_batch_facts: {} must be the host copy, got a {} tensor", what, input_ids.device().str());
  BatchFacts facts;
  check_token_ids(input_ids, vocab_size, what);
  facts.ids_checked = true;
  if (segment_ids.defined()) facts.packed = packed_layout(segment_ids, device);
  return facts;
}

// ---------------------------------------------------------------------------------------
// Config

torch::ScalarType dtype_from_string(const std::string& name, const std::string& source) {
  if (name == "float32" || name == "float") return torch::kFloat32;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16" || name == "half") return torch::kFloat16;
  fail("{}: torch_dtype {} is not supported (supported: float32, bfloat16, float16)", source,
       quote_excerpt(name));
}

std::string dtype_to_string(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: fail("dtype {} cannot be written as a model torch_dtype (float32, bfloat16, float16)",
                  c10::toString(dtype));
  }
}

LlamaConfig parse_llama_config(const std::string& json_text, const std::string& source) {
  const json file_json = parse_json(json_text, source);  // nesting bounded (core/json.h)
  if (!file_json.is_object()) fail("{}: not a JSON object", source);

  LlamaConfig c;
  // A gemma3 (multimodal) config: its text model's config (decoder_family.h).
  json j = text_model_config(file_json, &c.wrapper_model_type);
  c.json_text = c.wrapper_model_type.empty() ? json_text : j.dump(2) + "\n";
  auto model_type = optional_string(j, "model_type", source);
  if (!model_type) fail("{}: model_type is missing (supported: {})", source, supported_model_types());
  c.model_type = *model_type;
  family_spec(c.model_type, source);  // an unsupported model_type is an error naming the supported ones
  fill_family_defaults(j, c.model_type);
  if (const json* arch = field(j, "architectures")) {
    if (!arch->is_array()) fail("{}: architectures must be a list, got {}", source, json_excerpt(*arch));
    for (const auto& a : *arch) {
      if (!a.is_string()) fail("{}: architectures must list strings, got {}", source, json_excerpt(a));
      const std::string name = a.get<std::string>();
      const std::string suffix = "ForCausalLM";
      if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
        fail("{}: architectures entry {} is not supported (replica loads *ForCausalLM models)", source,
             quote_excerpt(name));
      }
    }
  }
  if (const json* q = field(j, "quantization_config")) {
    // GPT-OSS's published checkpoints: the experts in MXFP4, dequantized as they are loaded
    // (models/mxfp4.h); every other quantization_config is refused.
    const bool mxfp4 = c.model_type == "gpt_oss" && q->is_object() && q->value("quant_method", json()) == json("mxfp4");
    if (!mxfp4) {
      fail("{}: quantization_config is not supported (quantized weights); got {}", source, json_excerpt(*q));
    }
    c.mxfp4_experts = true;
  }
  if (field(j, "partial_rotary_factor") &&
      optional_number(j, "partial_rotary_factor", source, 1.0) != 1.0) {
    fail("{}: partial_rotary_factor {} is not supported (only 1.0)", source,
         optional_number(j, "partial_rotary_factor", source, 1.0));
  }
  const bool gemma = c.model_type == "gemma3_text";
  const bool olmo = c.model_type == "olmo2" || c.model_type == "olmo3";
  // Sizes: required, except where the config class has defaults that save_pretrained may
  // leave out (Gemma 3's text_config of a multimodal checkpoint lists only what differs).
  // Each in [1, its bound] (Note [config.json bounds] in config_json.h).
  auto size = [&](const char* key, int64_t gemma_default, int64_t max) {
    if (gemma && !field(j, key)) return gemma_default;
    return required_int(j, key, source, max);
  };
  c.vocab_size = size("vocab_size", 262208, kMaxVocabSize);
  c.hidden_size = size("hidden_size", 2304, kMaxHiddenSize);
  c.intermediate_size = size("intermediate_size", 9216, kMaxIntermediateSize);
  c.num_hidden_layers = size("num_hidden_layers", 26, kMaxLayers);
  c.num_attention_heads = size("num_attention_heads", 8, kMaxHeads);
  c.num_key_value_heads = field(j, "num_key_value_heads") ? required_int(j, "num_key_value_heads", source, kMaxHeads)
                          : gemma                         ? 4
                                                          : c.num_attention_heads;
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    fail("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", source,
         c.num_attention_heads, c.num_key_value_heads);
  }
  if (field(j, "head_dim") || gemma) {
    c.head_dim = gemma && !field(j, "head_dim") ? 256 : required_int(j, "head_dim", source, kMaxHeadDim);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      fail("{}: hidden_size {} is not a multiple of num_attention_heads {} (and head_dim is not given)",
           source, c.hidden_size, c.num_attention_heads);
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) fail("{}: head_dim {} must be even (rotary embeddings)", source, c.head_dim);

  c.rms_norm_eps = optional_number(j, "rms_norm_eps", source, olmo ? 1e-5 : 1e-6);
  c.rope_theta = optional_number(j, "rope_theta", source, gemma ? 1e6 : 10000.0);
  c.max_position_embeddings =
      optional_int(j, "max_position_embeddings", source, gemma ? 131072 : 2048, 1, kMaxPositions);
  if (const json* r = field(j, "rope_scaling")) {
    c.rope_scaling = parse_rope_scaling(*r, "rope_scaling", source, c.max_position_embeddings);
  }
  if (const json* r = field(j, "rope_parameters")) {  // transformers v5 spelling
    c.rope_scaling = parse_rope_scaling(*r, "rope_parameters", source, c.max_position_embeddings);
    c.rope_theta = optional_number(*r, "rope_theta", source, c.rope_theta);
  }
  if (c.rope_theta <= 0) fail("{}: rope_theta must be positive, got {}", source, c.rope_theta);
  // Gemma3TextConfig ties by default (and save_pretrained then leaves the field out).
  c.tie_word_embeddings = optional_bool(j, "tie_word_embeddings", source, gemma);
  c.attention_dropout = optional_number(j, "attention_dropout", source, 0.0);
  if (c.attention_dropout < 0 || c.attention_dropout >= 1) {
    fail("{}: attention_dropout must be in [0, 1), got {}", source, c.attention_dropout);
  }
  c.initializer_range = optional_number(j, "initializer_range", source, 0.02);

  const bool attention_bias = optional_bool(j, "attention_bias", source, false);
  const bool mlp_bias = optional_bool(j, "mlp_bias", source, false);
  if (c.model_type == "llama") {
    c.qkv_bias = c.o_bias = attention_bias;  // LlamaAttention: bias=config.attention_bias on all four
    c.mlp_bias = mlp_bias;
  } else if (c.model_type == "qwen3") {
    c.qkv_bias = c.o_bias = attention_bias;
  } else if (c.model_type == "qwen2") {
    c.qkv_bias = true;  // Qwen2Attention: q/k/v always biased, o_proj never
  }
  if (c.model_type != "llama" && mlp_bias) fail("{}: mlp_bias true is not supported for {}", source, c.model_type);
  if ((c.model_type == "mistral" || c.model_type == "qwen2") && attention_bias) {
    fail("{}: attention_bias true is not supported for {}", source, c.model_type);
  }

  std::optional<std::string> dtype = optional_string(j, "torch_dtype", source);
  if (!dtype) dtype = optional_string(j, "dtype", source);
  if (dtype) {
    dtype_from_string(*dtype, source);  // validates
    c.torch_dtype = *dtype;
  }

  // Token ids; the Olmo and Gemma 3 config classes have defaults for them (an absent field is
  // the default there, as transformers reads it).
  std::optional<int64_t> default_pad, default_bos;
  std::optional<int64_t> default_eos;
  if (olmo) default_pad = 1, default_eos = 50279;
  if (gemma) default_pad = 0, default_eos = 1, default_bos = 2;
  auto token_id = [&](const char* key, std::optional<int64_t> def) {
    return j.contains(key) ? optional_token_id(j, key, source) : def;
  };
  c.bos_token_id = token_id("bos_token_id", default_bos);
  c.pad_token_id = token_id("pad_token_id", default_pad);
  if (const json* eos = field(j, "eos_token_id")) {
    if (eos->is_array()) {
      for (const auto& e : *eos) c.eos_token_ids.push_back(as_int(e, "eos_token_id", source));
    } else {
      c.eos_token_ids.push_back(as_int(*eos, "eos_token_id", source));
    }
  } else if (!j.contains("eos_token_id") && default_eos) {
    c.eos_token_ids.push_back(*default_eos);
  }
  if (c.pad_token_id && (*c.pad_token_id < 0 || *c.pad_token_id >= c.vocab_size)) {
    c.pad_token_id.reset();  // HF would fail in nn.Embedding; an out-of-range pad just means "none"
  }
  // Norms, q/k norms, activation, sliding-window layers, Gemma 3's extras (decoder_family.cpp).
  parse_family_fields(j, source, c);
  return c;
}

LlamaConfig read_llama_config_file(const std::string& path) {
  if (!std::filesystem::exists(path)) fail("{}: missing (a model directory needs config.json)", path);
  // Regular files only, never blocking on a FIFO, and bounded: config.json is a few KB.
  return parse_llama_config(read_file(path, kMaxConfigJsonBytes), path);
}

double LlamaConfig::attention_scale() const {
  // LlamaAttention: head_dim**-0.5; Gemma3Attention: query_pre_attn_scalar**-0.5.
  return std::pow(query_pre_attn_scalar ? *query_pre_attn_scalar : static_cast<double>(head_dim), -0.5);
}

std::string LlamaConfig::to_json_string() const {
  json j;
  if (!json_text.empty()) {
    j = parse_json(json_text, "config.json");  // parsed (and checked) once already
    if (j.contains("dtype") && !j.contains("torch_dtype")) {
      j["dtype"] = torch_dtype;
    } else {
      j["torch_dtype"] = torch_dtype;
    }
    if (mxfp4_experts) j.erase("quantization_config");  // saved weights are dequantized
    if (num_local_experts > 0) {  // set_router_aux_loss may have changed them
      j["output_router_logits"] = output_router_logits;
      j["router_aux_loss_coef"] = router_aux_loss_coef;
    }
    return j.dump(2) + "\n";
  }
  // A fresh config in the layout transformers' save_pretrained writes (sorted keys).
  j["architectures"] = json::array({family_spec(model_type, "config").architecture});
  j["model_type"] = model_type;
  j["attention_dropout"] = attention_dropout;
  j["bos_token_id"] = bos_token_id ? json(*bos_token_id) : json(nullptr);
  if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else if (eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else {
    j["eos_token_id"] = eos_token_ids;
  }
  j["pad_token_id"] = pad_token_id ? json(*pad_token_id) : json(nullptr);
  j["head_dim"] = head_dim;
  const char* act = activation == Activation::kSilu ? "silu" : "gelu_pytorch_tanh";
  j[model_type == "gemma3_text" ? "hidden_activation" : "hidden_act"] = act;
  j["hidden_size"] = hidden_size;
  j["initializer_range"] = initializer_range;
  j["intermediate_size"] = intermediate_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["num_attention_heads"] = num_attention_heads;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_key_value_heads"] = num_key_value_heads;
  j["rms_norm_eps"] = rms_norm_eps;
  if (!rope_scaling) {
    j["rope_scaling"] = nullptr;
  } else if (rope_scaling->rope_type == "llama3") {
    j["rope_scaling"] = {{"rope_type", rope_scaling->rope_type},
                         {"factor", rope_scaling->factor},
                         {"low_freq_factor", rope_scaling->low_freq_factor},
                         {"high_freq_factor", rope_scaling->high_freq_factor},
                         {"original_max_position_embeddings", rope_scaling->original_max_position_embeddings}};
  } else if (rope_scaling->rope_type == "linear") {
    j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", rope_scaling->factor}};
  } else {
    const RopeScaling& r = *rope_scaling;
    j["rope_scaling"] = {{"rope_type", r.rope_type}, {"factor", r.factor},
                         {"original_max_position_embeddings", r.original_max_position_embeddings},
                         {"beta_fast", r.beta_fast}, {"beta_slow", r.beta_slow}, {"truncate", r.truncate}};
    if (r.attention_factor) j["rope_scaling"]["attention_factor"] = *r.attention_factor;
    if (r.mscale) j["rope_scaling"]["mscale"] = *r.mscale;
    if (r.mscale_all_dim) j["rope_scaling"]["mscale_all_dim"] = *r.mscale_all_dim;
  }
  j["rope_theta"] = rope_theta;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["torch_dtype"] = torch_dtype;
  j["use_cache"] = true;
  j["vocab_size"] = vocab_size;
  if (model_type != "mistral" && model_type != "qwen2") j["attention_bias"] = o_bias;
  if (model_type == "llama") {
    j["mlp_bias"] = mlp_bias;
    j["pretraining_tp"] = 1;
  }
  json layer_types = json::array();
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    layer_types.push_back(layer_slides(i) ? "sliding_attention" : "full_attention");
  }
  if (model_type == "mistral") j["sliding_window"] = sliding_window ? json(*sliding_window) : json(nullptr);
  if (model_type == "qwen2" || model_type == "qwen3") {
    j["use_sliding_window"] = sliding_window.has_value();
    j["sliding_window"] = sliding_window ? json(*sliding_window) : json(nullptr);
    j["max_window_layers"] = num_hidden_layers;
    j["layer_types"] = layer_types;
  }
  if (model_type == "olmo3" || model_type == "gemma3_text") {
    j["sliding_window"] = sliding_window.value_or(4096);
    j["layer_types"] = layer_types;
  }
  if (model_type == "gemma3_text") {
    j["query_pre_attn_scalar"] = query_pre_attn_scalar.value_or(static_cast<double>(head_dim));
    j["rope_local_base_freq"] = local_rope_theta.value_or(10000.0);
    j["final_logit_softcapping"] = final_logit_softcapping ? json(*final_logit_softcapping) : json(nullptr);
    j["attn_logit_softcapping"] = nullptr;
    j["use_bidirectional_attention"] = false;
  }
  if (model_type == "gpt_oss") {
    j["sliding_window"] = sliding_window.value_or(128);
    j["layer_types"] = layer_types;
    j["num_local_experts"] = num_local_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["output_router_logits"] = output_router_logits;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
  }
  return j.dump(2) + "\n";
}

// ---------------------------------------------------------------------------------------
// Layers

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t dim, std::optional<int64_t> padding_idx,
                             torch::ScalarType dtype, std::optional<double> scale)
    : scale_(scale) {
  weight = register_parameter("weight", torch::empty({num_embeddings, dim}, torch::dtype(dtype)));
  padding_idx_ = padding_idx.value_or(-1);
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
  // F.embedding(ids, weight, padding_idx): a row lookup; the pad row's gradient is dropped.
  // Quantized: only the looked-up rows are dequantized (frozen: no gradient to drop).
  auto out = quantized_.defined() ? dequantize_rows(quantized_, ids) : torch::embedding(weight, ids, padding_idx_);
  if (!scale_) return out;
  // Gemma3TextScaledWordEmbedding: embed_scale (an fp32 tensor of sqrt(hidden_size)) cast to
  // the weight's dtype, times the rows.
  auto scale = torch::scalar_tensor(static_cast<float>(*scale_), out.options().dtype(torch::kFloat32));
  return out * scale.to(out.scalar_type());
}

torch::Tensor EmbeddingImpl::as_head(const torch::Tensor& h) {
  return quantized_.defined() ? quantized_linear(h, quantized_) : models::linear(h, weight);
}

void EmbeddingImpl::quantize_base(const QuantOptions& options) {
  if (quantized_.defined()) fail("Embedding: the table is already quantized");
  if (!options.enabled()) fail("Embedding: quantize_base needs a quantization (int4 or int8), got none");
  quantized_ = quantize(weight, options);
  parameters_.erase("weight");  // as LoraLinearImpl::quantize_base: nothing sees or steps it
  weight = torch::Tensor();
}

torch::Tensor EmbeddingImpl::base_weight() const { return quantized_.defined() ? dequantize(quantized_) : weight; }

void EmbeddingImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, dtype, non_blocking);
  follow_module_to(quantized_, device, dtype, non_blocking);
}

void EmbeddingImpl::to(torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(dtype, non_blocking);
  follow_module_to(quantized_, std::nullopt, dtype, non_blocking);
}

void EmbeddingImpl::to(torch::Device device, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  follow_module_to(quantized_, device, std::nullopt, non_blocking);
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, torch::ScalarType dtype, NormStyle style)
    : eps_(eps), style_(style) {
  // Gemma3RMSNorm's weight is the offset from one (initialised to zero).
  weight = register_parameter("weight", style == NormStyle::kOnePlusWeight ? torch::zeros({dim}, torch::dtype(dtype))
                                                                           : torch::ones({dim}, torch::dtype(dtype)));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // One fused kernel where the family multiplies by the weight (Note [fused kernels]).
  if (style_ != NormStyle::kOnePlusWeight && x.scalar_type() == weight.scalar_type() && fused_kernels_for(x)) {
    return fused_rms_norm(x, weight, eps_);
  }
  // Normalise in fp32, then apply the weight where the family's RMSNorm does.
  const auto input_dtype = x.scalar_type();
  auto h = x.to(torch::kFloat32);
  auto variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * torch::rsqrt(variance + eps_);
  switch (style_) {
    case NormStyle::kWeightAfterCast:  // LlamaRMSNorm: weight * hidden.to(input_dtype)
      return weight * h.to(input_dtype);
    case NormStyle::kWeightBeforeCast:  // Olmo2RMSNorm: (weight * hidden).to(input_dtype)
      return (weight * h).to(input_dtype);
    case NormStyle::kOnePlusWeight:  // Gemma3RMSNorm: (hidden * (1 + weight.float())).type_as(x)
      return (h * (1.0 + weight.to(torch::kFloat32))).to(input_dtype);
  }
  return h;
}

namespace {

// _compute_default_rope_parameters: inv_freq[i] = 1 / theta^(2i / dim), in fp32.
torch::Tensor default_inv_freq(int64_t dim, double theta) {
  auto exponent = torch::arange(0, dim, 2, torch::kInt64).to(torch::kFloat32) / dim;
  return torch::reciprocal(torch::pow(torch::scalar_tensor(theta, torch::kFloat32), exponent));
}

// _compute_llama3_parameters: keep high frequencies (wavelength < original context /
// high_freq_factor), divide low frequencies (wavelength > original context / low_freq_factor)
// by factor, and interpolate smoothly in between.
torch::Tensor llama3_inv_freq(const torch::Tensor& inv_freq, const RopeScaling& s) {
  const double old_context_len = static_cast<double>(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_context_len / s.low_freq_factor;
  const double high_freq_wavelen = old_context_len / s.high_freq_factor;
  auto wavelen = torch::reciprocal(inv_freq) * (2 * M_PI);
  auto inv_freq_llama = torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  auto smooth_factor = (torch::reciprocal(wavelen) * old_context_len - s.low_freq_factor) /
                       (s.high_freq_factor - s.low_freq_factor);
  auto smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / s.factor + smooth_factor * inv_freq_llama;
  auto is_medium_freq = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return torch::where(is_medium_freq, smoothed_inv_freq, inv_freq_llama);
}

}  // namespace

RotaryEmbedding::RotaryEmbedding(const LlamaConfig& config) {
  const int64_t dim = config.head_dim;
  if (!config.rope_scaling) {
    inv_freq_ = default_inv_freq(dim, config.rope_theta);
  } else if (config.rope_scaling->rope_type == "llama3") {
    inv_freq_ = llama3_inv_freq(default_inv_freq(dim, config.rope_theta), *config.rope_scaling);
  } else if (config.rope_scaling->rope_type == "linear") {
    // _compute_linear_scaling_rope_parameters: the default frequencies divided by factor.
    inv_freq_ = default_inv_freq(dim, config.rope_theta) / config.rope_scaling->factor;
  } else {
    // _compute_yarn_parameters (models/rope_yarn.h), with its attention factor on cos/sin.
    std::tie(inv_freq_, attention_scaling_) =
        yarn_inv_freq(*config.rope_scaling, config.rope_theta, dim, config.max_position_embeddings);
  }
}

RotaryEmbedding::RotaryEmbedding(const LlamaConfig& config, double theta)
    : inv_freq_(default_inv_freq(config.head_dim, theta)) {}

std::pair<torch::Tensor, torch::Tensor> RotaryEmbedding::forward(const torch::Tensor& position_ids,
                                                                 torch::ScalarType dtype) {
  // LlamaRotaryEmbedding.forward: angles = position * inv_freq in fp32, duplicated across the
  // two halves of head_dim (the rotate_half layout), then cos/sin (times attention_scaling)
  // cast to the compute dtype.
  if (inv_freq_.device() != position_ids.device()) inv_freq_ = inv_freq_.to(position_ids.device());
  auto freqs = position_ids.to(torch::kFloat32).unsqueeze(-1) * inv_freq_;  // [B, T, D/2]
  auto emb = torch::cat({freqs, freqs}, -1);                                 // [B, T, D]
  auto cos = emb.cos(), sin = emb.sin();
  if (attention_scaling_ != 1.0) {
    cos = cos * attention_scaling_;
    sin = sin * attention_scaling_;
  }
  return {cos.to(dtype), sin.to(dtype)};
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c, torch::ScalarType dtype, bool init)
    : num_heads_(c.num_attention_heads),
      num_kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      attention_dropout_(c.attention_dropout),
      scaling_(c.attention_scale()),
      qk_norm_(c.qk_norm),
      rope_in_fp32_(c.rope_in_fp32) {
  const double std = c.initializer_range;
  q_proj = register_module("q_proj", LoraLinear(c.hidden_size, num_heads_ * head_dim_, c.qkv_bias, dtype, init, std));
  k_proj = register_module("k_proj", LoraLinear(c.hidden_size, num_kv_heads_ * head_dim_, c.qkv_bias, dtype, init, std));
  v_proj = register_module("v_proj", LoraLinear(c.hidden_size, num_kv_heads_ * head_dim_, c.qkv_bias, dtype, init, std));
  o_proj = register_module("o_proj", LoraLinear(num_heads_ * head_dim_, c.hidden_size, c.o_bias, dtype, init, std));
  if (c.attention_sinks) {
    sinks = register_parameter("sinks", torch::empty({num_heads_}, torch::dtype(dtype)));
    if (init) {
      torch::NoGradGuard no_grad;
      sinks.normal_(0.0, std);
    }
  }
  if (qk_norm_ != QkNorm::kNone) {
    // Per head (Qwen3, Gemma 3): [head_dim]; over the whole projection (Olmo): [heads * head_dim].
    const bool whole = qk_norm_ == QkNorm::kWholeProjection;
    q_norm = register_module("q_norm", RMSNorm(whole ? num_heads_ * head_dim_ : head_dim_, c.rms_norm_eps, dtype,
                                               c.norm_style));
    k_norm = register_module("k_norm", RMSNorm(whole ? num_kv_heads_ * head_dim_ : head_dim_, c.rms_norm_eps, dtype,
                                               c.norm_style));
  }
}

namespace {

// Note [grouped-query attention and the math kernel]
// enable_gqa lets a kernel read each key/value head for its num_heads / num_kv_heads query
// heads without copies, but only some kernels take it: on CPU ATen's flash kernel does in every
// dtype, with or without a mask; on CUDA FlashAttention-2 does (fp16/bf16, no mask), while the
// memory-efficient and cuDNN kernels refuse mismatched head counts. Where none takes it (fp32
// on CUDA; any mask on CUDA, packed sequences and sliding windows) ATen falls back, silently, to
// the math path, which materialises the [B, heads, T, T] scores, their softmax and both
// gradients: on a 349M Llama shape at T = 2048 in fp32 that is 256 MiB per tensor and set the
// CUDA peak of a LoRA step (bench/memory_llm: 2,847 MiB, the same as transformers', whose
// sdpa path passes enable_gqa whenever there is no mask). So ATen is asked which kernel it
// would pick (its own dispatch, _fused_sdp_choice, so no kernel rule is restated here); if it is
// the math path, the key/value heads are repeated (2 x B x heads x T x D, 16 MiB there) and the
// call goes to a fused kernel that reads them as ordinary heads. Where math is all there is
// (ATen's fused kernels turned off, unusual head sizes) nothing changes but the copy.
bool grouped_kv_takes_the_math_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      const std::optional<at::Tensor>& mask, double dropout, bool causal,
                                      double scale) {
  const auto math = static_cast<int64_t>(at::SDPBackend::math);
  return at::_fused_sdp_choice(q, k, v, mask, dropout, causal, scale, /*enable_gqa=*/true) == math;
}

}  // namespace

// Note [attention kernel]
// Attention is at::scaled_dot_product_attention, transformers' default attention
// (attn_implementation="sdpa"), not the matmul / softmax / matmul of its eager path. ATen
// picks the kernel: on CPU a blocked flash-attention kernel that never materialises the
// [B, h, T, T] scores and, under is_causal, skips the key blocks above the diagonal; on CUDA
// FlashAttention-2 or the memory-efficient kernel; the math path (eager's three steps) where
// neither applies. Scores, softmax and the running sums are fp32 in every kernel, so in fp32
// the result equals eager's within float rounding (1e-6 on the model tests) and in bf16 it
// equals transformers' own sdpa path (the eager path rounds the probabilities to bf16 before
// multiplying by v; the two differ by about one bf16 ulp of a logit). Plain causal attention
// passes no mask (is_causal); sliding-window layers pass their [B, 1, T, T] bool mask (as
// transformers' sdpa path does for a sliding window). Packed sequences take the varlen path
// without a mask (varlen_attention.h: FlashAttention-2 over cumulative sequence lengths on
// CUDA, a causal call per segment on the CPU) or, where that path does not apply (sliding
// windows, GPT-OSS's sinks, attention dropout, CUDA without the flash kernel) or
// REPLICA_PACKED_ATTENTION=mask says so, their block-diagonal causal mask: one function decides
// (choose_packed_attention, Note [packed attention] in varlen_attention.cpp), and the mask is
// built only when a layer takes it (AttentionRows). On the LLM step benchmark (bench/llama_step, 5 layers, 4 x 256 tokens, one CPU thread) it takes about
// 14 ms per layer less than the three-step path, forward and backward.
torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                          const torch::Tensor& sin, const AttentionRows& rows) {
  const int64_t B = x.size(0), T = x.size(1);
  auto q = q_proj(x);
  auto k = k_proj(x);
  // Olmo 2/3: RMSNorm over the whole projection, before it is split into heads.
  if (qk_norm_ == QkNorm::kWholeProjection) {
    q = q_norm(q);
    k = k_norm(k);
  }
  // Per-head queries, keys and values: [B, T, heads, D].
  q = q.view({B, T, num_heads_, head_dim_});
  k = k.view({B, T, num_kv_heads_, head_dim_});
  auto v = v_proj(x).view({B, T, num_kv_heads_, head_dim_});
  // Qwen3, Gemma 3: RMSNorm over each head's vector, before rotary.
  if (qk_norm_ == QkNorm::kPerHead) {
    q = q_norm(q);
    k = k_norm(k);
  }
  // [B, heads, T, D], then rotate q and k by their positions. Olmo's apply_rotary_pos_emb
  // rotates in fp32 (its cos/sin stay fp32) and casts back to q's and k's dtype.
  if (fused_kernels_for(q)) {
    // One kernel per tensor, before the transpose (Note [fused kernels]): written in
    // the dtype attention reads, the autocast dtype under autocast (GPT-OSS's eager sink path
    // aside), else what HF's q * cos gives.
    const auto device = q.device().type();
    auto rotated = [&](const torch::Tensor& t) {
      torch::ScalarType out = rope_in_fp32_ ? t.scalar_type() : at::promote_types(t.scalar_type(), cos.scalar_type());
      if (!rope_in_fp32_ && !sinks.defined() && at::autocast::is_autocast_enabled(device)) {
        out = at::autocast::get_autocast_dtype(device);
      }
      return fused_rotary(t, cos, sin, out).transpose(1, 2);
    };
    q = rotated(q);
    k = rotated(k);
  } else {
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
    if (rope_in_fp32_ && q.scalar_type() != cos.scalar_type()) {
      const auto qt = q.scalar_type(), kt = k.scalar_type();
      q = apply_rotary(q.to(cos.scalar_type()), cos, sin).to(qt);
      k = apply_rotary(k.to(cos.scalar_type()), cos, sin).to(kt);
    } else {
      q = apply_rotary(q, cos, sin);
      k = apply_rotary(k, cos, sin);
    }
  }
  v = v.transpose(1, 2);
  // softmax(q k^T * scale, masked) v through ATen's fused attention; see Note [attention
  // kernel]. Grouped-query attention: each key/value head serves num_heads / num_kv_heads
  // query heads (enable_gqa, HF's repeat_kv without the copies).
  const double dropout = attention_dropout_ > 0 && is_training() ? attention_dropout_ : 0.0;
  // The dtype the kernel computes in: autocast's where it is on for q's device (it casts
  // attention's operands), else q's.
  const auto device = q.device().type();
  const auto attention_dtype = (q.is_cpu() || q.is_cuda()) && at::autocast::is_autocast_enabled(device)
                                   ? at::autocast::get_autocast_dtype(device)
                                   : q.scalar_type();
  const bool fp16_through_fp32 = q.is_cpu() && attention_dtype == torch::kHalf && cpu_fp16_through_fp32();
  // Packed rows: the mask or the varlen path, decided in one place (Note [packed attention]).
  PackedAttention packed_path = PackedAttention::kMask;
  torch::Tensor qa, ka, va;  // q, k, v in attention_dtype, for the flash kernel (which autocast does not cast for)
  if (rows.packed() != nullptr && rows.packed()->defined()) {
    PackedAttentionCall call;
    call.sliding = rows.sliding();
    call.sinks = sinks.defined();
    call.dropout = dropout;
    call.cuda = q.is_cuda();
    if (call.cuda) {
      qa = q.to(attention_dtype), ka = k.to(attention_dtype), va = v.to(attention_dtype);
      call.flash_takes = flash_varlen_takes(qa, ka, va, scaling_);
    }
    packed_path = choose_packed_attention(call);
  }
  if (sinks.defined()) {
    // GPT-OSS: the sink column in every softmax (attention_sinks.h: the eager path, as transformers).
    auto out = attention_with_sinks(q, k, v, rows.mask(), sinks, scaling_, dropout, is_training());
    return o_proj(out.transpose(1, 2).reshape({B, T, num_heads_ * head_dim_}));
  }
  if (packed_path != PackedAttention::kMask) {
    // [B, heads, T, D] -> the rows' tokens in one stream, [B T, heads, D] (a view where the
    // fused rotary wrote [B, T, heads, D]).
    auto stream = [&](const torch::Tensor& t) { return t.transpose(1, 2).reshape({B * T, t.size(1), head_dim_}); };
    torch::Tensor out;
    if (packed_path == PackedAttention::kFlashVarlen) {
      out = varlen_attention(stream(qa), stream(ka), stream(va), *rows.packed(), scaling_, packed_path);
    } else if (fp16_through_fp32) {
      // As the mask path below (Note [fp16 attention through fp32 on CPUs without fp16 arithmetic]).
      const auto f32 = [&](const torch::Tensor& t) { return stream(t).to(torch::kHalf).to(torch::kFloat32); };
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
      out = varlen_attention(f32(q), f32(k), f32(v), *rows.packed(), scaling_, packed_path).to(torch::kHalf);
    } else {
      out = varlen_attention(stream(q), stream(k), stream(v), *rows.packed(), scaling_, packed_path);
    }
    return o_proj(out.reshape({B, T, num_heads_ * head_dim_}));
  }
  const bool causal = rows.causal();
  const auto mask = causal ? std::optional<at::Tensor>() : std::optional<at::Tensor>(rows.mask());
  bool gqa = num_heads_ != num_kv_heads_;
  if (gqa && grouped_kv_takes_the_math_kernel(q, k, v, mask, dropout, causal, scaling_)) {
    // Note [grouped-query attention and the math kernel]: the key/value heads repeated, as
    // HF's repeat_kv, so that a fused kernel takes the call.
    const int64_t groups = num_heads_ / num_kv_heads_;
    k = k.repeat_interleave(groups, /*dim=*/1);
    v = v.repeat_interleave(groups, /*dim=*/1);
    gqa = false;
  }
  torch::Tensor out;
  if (fp16_through_fp32) {
    // Note [fp16 attention through fp32 on CPUs without fp16 arithmetic]
    // ATen's CPU flash kernel multiplies fp16 with its generic GEMM loop on a CPU without
    // AVX512-FP16 / AMX-FP16: 6.8x the fp32 kernel's time, forward and backward, on the LLM step
    // benchmark (2.6 s of a 5.9 s step), the largest cost of mixed_precision: fp16 once the
    // layers' GEMMs went through fp32 (models/linear.h). So fp16 attention takes the fp32 kernel there, on q, k, v rounded
    // to fp16 (as autocast casts them) and widened exactly, its output rounded to fp16 once (the backward, through the casts, gives
    // fp16 gradients of q, k, v). The one rounding point it drops is the fp16 kernels' rounding
    // of the probabilities before the product with v (ATen's CPU kernel and FlashAttention on a
    // GPU both make it): the result is that much closer to exact, within an fp16 ulp of theirs.
    // REPLICA_CPU_FP16_GEMM=aten restores ATen's fp16 kernel with the GEMMs'.
    const auto f32 = [](const torch::Tensor& t) { return t.to(torch::kHalf).to(torch::kFloat32); };
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);  // autocast would cast back
    out = at::scaled_dot_product_attention(f32(q), f32(k), f32(v), mask, dropout, causal, scaling_, gqa)
              .to(torch::kHalf);
  } else {
    out = at::scaled_dot_product_attention(q, k, v, mask, dropout, causal, scaling_, gqa);
  }
  out = out.transpose(1, 2).reshape({B, T, num_heads_ * head_dim_});
  return o_proj(out);
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c, torch::ScalarType dtype, bool init) : activation_(c.activation) {
  const double std = c.initializer_range;
  gate_proj = register_module("gate_proj", LoraLinear(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype, init, std));
  up_proj = register_module("up_proj", LoraLinear(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype, init, std));
  down_proj = register_module("down_proj", LoraLinear(c.intermediate_size, c.hidden_size, c.mlp_bias, dtype, init, std));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  // The activated gate branch times the linear branch, projected back to hidden_size: SwiGLU,
  // or Gemma's GELU (tanh approximation, ACT2FN["gelu_pytorch_tanh"]).
  auto gate = gate_proj(x);
  if (activation_ == Activation::kSilu && fused_kernels_for(gate)) {
    return down_proj(fused_swiglu(gate, up_proj(x)));  // one kernel (Note [fused kernels])
  }
  gate = activation_ == Activation::kSilu ? torch::silu(gate) : torch::gelu(gate, "tanh");
  return down_proj(gate * up_proj(x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c, torch::ScalarType dtype, bool init, int64_t index)
    : layout_(c.block_layout), slides_(c.layer_slides(index)) {
  self_attn = register_module("self_attn", LlamaAttention(c, dtype, init));
  if (c.num_local_experts > 0) {
    MoeConfig m;
    m.hidden_size = c.hidden_size;
    m.intermediate_size = c.intermediate_size;
    m.num_experts = c.num_local_experts;
    m.top_k = c.num_experts_per_tok;
    m.initializer_range = c.initializer_range;
    moe = register_module("mlp", MoeMlp(m, dtype, init));
  } else {
    mlp = register_module("mlp", LlamaMLP(c, dtype, init));
  }
  auto norm = [&](const char* name) {
    return register_module(name, RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_style));
  };
  // The norms each family has, under transformers' names (registered in its order).
  if (layout_ != BlockLayout::kPostNorm) input_layernorm = norm("input_layernorm");
  post_attention_layernorm = norm("post_attention_layernorm");
  if (layout_ == BlockLayout::kSandwich) pre_feedforward_layernorm = norm("pre_feedforward_layernorm");
  if (layout_ != BlockLayout::kPreNorm) post_feedforward_layernorm = norm("post_feedforward_layernorm");
}

torch::Tensor LlamaDecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                             const torch::Tensor& sin, const AttentionRows& rows) {
  switch (layout_) {
    case BlockLayout::kPreNorm: {  // LlamaDecoderLayer
      auto h = x + self_attn(input_layernorm(x), cos, sin, rows);
      return h + feed_forward(post_attention_layernorm(h));
    }
    case BlockLayout::kPostNorm: {  // Olmo2DecoderLayer / Olmo3DecoderLayer
      auto h = x + post_attention_layernorm(self_attn(x, cos, sin, rows));
      return h + post_feedforward_layernorm(feed_forward(h));
    }
    case BlockLayout::kSandwich: {  // Gemma3DecoderLayer
      auto h = x + post_attention_layernorm(self_attn(input_layernorm(x), cos, sin, rows));
      return h + post_feedforward_layernorm(feed_forward(pre_feedforward_layernorm(h)));
    }
  }
  return x;
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c, torch::ScalarType dtype, bool init)
    : config_(c), rotary_(c) {
  if (c.local_rope_theta) local_rotary_.emplace(c, *c.local_rope_theta);
  std::optional<double> embed_scale;
  if (c.scale_embeddings) embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
  embed_tokens = register_module("embed_tokens",
                                 Embedding(c.vocab_size, c.hidden_size, c.pad_token_id, dtype, embed_scale));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(LlamaDecoderLayer(c, dtype, init, i));
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_style));
}

namespace {

// Whether a packed forward given no layout computes one (from segment_ids on a GPU, a
// device-to-host copy): only where a layer could take the varlen path. Under `auto` that is
// off CUDA (the loop) and CUDA in fp16 or bf16 (the flash kernel takes no other dtype); the
// layer decides the rest (choose_packed_attention).
bool varlen_could_take(const torch::Tensor& h) {
  const auto mode = packed_attention_mode();
  if (mode != PackedAttentionMode::kAuto) return mode == PackedAttentionMode::kVarlen;
  if (!h.is_cuda()) return true;
  const auto dtype = at::autocast::is_autocast_enabled(at::kCUDA) ? at::autocast::get_autocast_dtype(at::kCUDA)
                                                                   : h.scalar_type();
  return dtype == torch::kHalf || dtype == torch::kBFloat16;
}

}  // namespace

AttentionRows::AttentionRows(std::function<torch::Tensor()> build, std::shared_ptr<const PackedLayout> packed,
                             bool sliding)
    : build_(std::move(build)), mask_(std::make_shared<torch::Tensor>()), packed_(std::move(packed)), sliding_(sliding) {}

const torch::Tensor& AttentionRows::mask() const {
  static const torch::Tensor kCausal;  // no mask
  if (!build_) return kCausal;
  if (!mask_->defined()) *mask_ = build_();
  return *mask_;
}

torch::Tensor LlamaModelImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& position_ids,
                                      const torch::Tensor& segment_ids, const PackedLayout& packed) {
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  const auto device = input_ids.device();
  router_scores_.clear();
  auto h = run_layer(*embed_tokens, [&] { return embed_tokens(input_ids); });  // [B, T, H], parameter dtype

  // Which key positions each query position may attend to: causal (j <= i; left undefined,
  // the attention kernel's is_causal) and, when packing, only within its own segment:
  // [B, 1, T, T] of bool, built when a layer first asks for it (AttentionRows).
  auto idx = torch::arange(T, torch::TensorOptions().dtype(torch::kInt64).device(device));
  torch::Tensor positions = position_ids;
  std::shared_ptr<const PackedLayout> layout;
  if (segment_ids.defined()) {
    if (!positions.defined()) {
      // Positions restart at 0 at each segment start: t - (index of the segment's first token).
      auto is_start = torch::ones({B, T}, torch::TensorOptions().dtype(torch::kBool).device(device));
      if (T > 1) is_start.narrow(1, 1, T - 1).copy_(segment_ids.narrow(1, 1, T - 1) != segment_ids.narrow(1, 0, T - 1));
      auto start = torch::where(is_start, idx.expand({B, T}), torch::zeros_like(idx)).cummax(1);
      positions = idx.expand({B, T}) - std::get<0>(start);
    }
    if (packed.defined()) {
      layout = std::make_shared<const PackedLayout>(packed);
    } else if (varlen_could_take(h)) {
      layout = std::make_shared<const PackedLayout>(packed_layout(segment_ids, device));
    }
  }
  if (!positions.defined()) positions = idx.unsqueeze(0).expand({B, T});
  AttentionRows rows;
  if (segment_ids.defined()) {
    rows = AttentionRows(
        [segment_ids, idx, T] {
          auto same_segment = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1);  // [B, T, T]
          return (idx.view({T, 1}) >= idx.view({1, T})).unsqueeze(0).logical_and(same_segment).unsqueeze(1);
        },
        layout, /*sliding=*/false);
  }
  // Sliding-window layers: also j > i - sliding_window (transformers' sliding_window_overlay
  // on the token indices); a window covering the sequence is plain causal attention.
  AttentionRows sliding_rows = rows;
  if (config_.sliding_window && T > *config_.sliding_window) {
    const int64_t window = *config_.sliding_window;
    sliding_rows = AttentionRows(
        [segment_ids, idx, T, window] {
          auto distance = idx.view({T, 1}) - idx.view({1, T});  // i - j
          auto band = distance.ge(0).logical_and(distance.lt(window)).unsqueeze(0);  // [1, T, T]
          if (segment_ids.defined()) band = band.logical_and(segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1));
          return band.unsqueeze(1);
        },
        layout, /*sliding=*/true);
  }

  // Olmo rotates in fp32 (its rotary returns fp32 cos/sin); the others in the compute dtype.
  const auto rope_dtype = config_.rope_in_fp32 ? torch::kFloat32 : h.scalar_type();
  auto [cos, sin] = rotary_.forward(positions, rope_dtype);
  torch::Tensor local_cos = cos, local_sin = sin;
  if (local_rotary_) std::tie(local_cos, local_sin) = local_rotary_->forward(positions, rope_dtype);
  for (const auto& layer : *layers) {
    auto* decoder = layer->as<LlamaDecoderLayerImpl>();
    const bool slides = decoder->slides();
    const auto& c = slides ? local_cos : cos;
    const auto& s = slides ? local_sin : sin;
    const auto& mask = slides ? sliding_rows : rows;
    const bool collect = collect_router_scores_ && !decoder->moe.is_empty();
    h = run_layer(*layer, [&] {
      if (!recompute_layers_) {
        auto out = decoder->forward(h, c, s, mask);
        if (collect) router_scores_.push_back(decoder->router_scores());
        return out;
      }
      // The closure keeps what the recomputation in backward needs (the layer, cos, sin, mask).
      // Collected router scores are a second output of the checkpointed layer, so that the
      // load-balancing loss's gradient reaches the router through the recomputation too.
      auto outs = recomputed_outputs(*layer, [layer, c, s, mask, collect](const torch::Tensor& x) {
        auto* d = layer->as<LlamaDecoderLayerImpl>();
        std::vector<torch::Tensor> out{d->forward(x, c, s, mask)};
        if (collect) out.push_back(d->router_scores());
        return out;
      }, h);
      if (collect) router_scores_.push_back(outs[1]);
      return outs[0];
    });
  }
  return run_layer(*norm, [&] { return norm(h); });
}

std::vector<std::shared_ptr<torch::nn::Module>> LlamaModelImpl::hooked_layers() {
  std::vector<std::shared_ptr<torch::nn::Module>> out{embed_tokens.ptr()};
  for (const auto& layer : *layers) out.push_back(layer);
  out.push_back(norm.ptr());
  return out;
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& config, torch::ScalarType dtype, bool init)
    : config_(config) {
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16 && dtype != torch::kFloat16) {
    fail("LlamaForCausalLM: parameter dtype {} is not supported (float32, bfloat16, float16)",
         c10::toString(dtype));
  }
  checkpoint_dtype_ = dtype;
  model = register_module("model", LlamaModel(config, dtype, init));
  model->set_collect_router_scores(config.output_router_logits);
  if (!config.tie_word_embeddings) {
    lm_head = register_module("lm_head", LoraLinear(config.hidden_size, config.vocab_size, false, dtype, init,
                                                    config.initializer_range));
  }
  if (init) {
    // _init_weights for embeddings: N(0, initializer_range), pad row zero. (Linear layers
    // initialise themselves; norms start at ones.)
    torch::NoGradGuard no_grad;
    model->embed_tokens->weight.normal_(0.0, config.initializer_range);
    if (config.pad_token_id) model->embed_tokens->weight[*config.pad_token_id].zero_();
  }
}

torch::Tensor LlamaForCausalLMImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& position_ids,
                                            const torch::Tensor& segment_ids, const BatchFacts& facts) {
  if (input_ids.dim() != 2) fail("LlamaForCausalLM: input_ids must be [batch, seq], got shape {}",
                                 c10::str(input_ids.sizes()));
  if (!at::isIntegralType(input_ids.scalar_type(), /*includeBool=*/false)) {
    fail("LlamaForCausalLM: input_ids must be integer token ids, got {}", c10::toString(input_ids.scalar_type()));
  }
  for (const auto* t : {&position_ids, &segment_ids}) {
    if (t->defined() && t->sizes() != input_ids.sizes()) {
      fail("LlamaForCausalLM: {} has shape {}, input_ids {}", t == &position_ids ? "position_ids" : "segment_ids",
           c10::str(t->sizes()), c10::str(input_ids.sizes()));
    }
  }
  if (!facts.ids_checked) check_token_ids(input_ids, config_.vocab_size, "LlamaForCausalLM input_ids");

  auto ids = input_ids.to(torch::kInt64);
  auto h = model(ids, position_ids.defined() ? position_ids.to(torch::kInt64) : position_ids, segment_ids, facts.packed);
  // The output head: hidden -> vocabulary logits (tied: the embedding matrix itself, unscaled).
  auto logits = lm_head.is_empty()
                    ? run_layer(*model->embed_tokens, [&] { return model->embed_tokens->as_head(h); })
                    : run_layer(*lm_head, [&] { return lm_head(h); });
  if (config_.final_logit_softcapping) {
    // Gemma3ForCausalLM: logits / cap, tanh, * cap (in the logits' dtype).
    const double cap = *config_.final_logit_softcapping;
    logits = torch::tanh(logits / cap) * cap;
  }
  return logits;
}

TokenLoss LlamaForCausalLMImpl::loss_sum(const torch::Tensor& input_ids, const torch::Tensor& labels,
                                         const torch::Tensor& segment_ids, int64_t chunk_tokens,
                                         const BatchFacts& facts) {
  const bool plain_head = !config_.final_logit_softcapping && (lm_head.is_empty() || !lm_head->has_lora());
  // transformers' load-balancing loss counts the tokens of its attention mask: not the pads
  // (segment -1, tasks/llm_sft/llm_sft.h).
  auto with_aux = [&](TokenLoss parts) {
    parts.aux = router_aux_loss(segment_ids.defined() ? segment_ids.ge(0) : torch::Tensor());
    return parts;
  };
  if (!plain_head) return with_aux(causal_lm_loss_sum(forward(input_ids, {}, segment_ids, facts), labels, segment_ids));
  if (labels.sizes() != input_ids.sizes()) {
    fail("LlamaForCausalLM::loss_sum: labels shape {} does not match input_ids {}", c10::str(labels.sizes()),
         c10::str(input_ids.sizes()));
  }
  if (!facts.ids_checked) check_token_ids(input_ids, config_.vocab_size, "LlamaForCausalLM input_ids");
  auto h = model(input_ids.to(torch::kInt64), torch::Tensor(), segment_ids, facts.packed);
  auto targets = causal_lm_targets(labels, segment_ids).view({-1});
  auto flat = h.reshape({-1, h.size(-1)});
  // A chunk's logits, their exp and its gradient are the step's largest transients: 32 MiB of
  // fp32 logits (256 tokens at a 32k vocabulary, 64 at Llama 3's 128k) keeps them small while
  // each chunk's matmul stays large enough to run at full speed.
  if (chunk_tokens <= 0) chunk_tokens = std::max<int64_t>(64, (int64_t{32} << 20) / (4 * config_.vocab_size));
  // Through the head's layer hook, as forward() goes: ZeRO-3 gathers the head around it. A
  // quantized head is dequantized for it (Note [quantized embeddings]).
  auto sum = lm_head.is_empty()
                 ? run_layer(*model->embed_tokens, [&] {
                     return linear_cross_entropy_sum(flat, model->embed_tokens->base_weight(), {}, targets,
                                                     chunk_tokens);
                   })
                 : run_layer(*lm_head, [&] {
                     return linear_cross_entropy_sum(flat, lm_head->base_weight(), lm_head->bias, targets,
                                                     chunk_tokens);
                   });
  return with_aux({sum, (targets != -100).sum()});
}

void LlamaForCausalLMImpl::set_router_aux_loss(double coef) {
  if (coef < 0) fail("router_aux_loss_coef must be >= 0, got {}", coef);
  if (config_.num_local_experts == 0 && coef > 0) {
    fail("router_aux_loss_coef {}: the model ({}) has no mixture-of-experts router", coef, config_.model_type);
  }
  config_.output_router_logits = coef > 0;
  config_.router_aux_loss_coef = coef > 0 ? coef : config_.router_aux_loss_coef;
  model->set_collect_router_scores(config_.output_router_logits);
}

torch::Tensor LlamaForCausalLMImpl::router_aux_loss(const torch::Tensor& token_mask) const {
  if (!config_.output_router_logits || model->router_scores().empty()) return {};
  return load_balancing_loss(model->router_scores(), config_.num_local_experts, config_.num_experts_per_tok,
                             token_mask) *
         config_.router_aux_loss_coef;
}

// Note [quantized embeddings]
// bitsandbytes (QLoRA through transformers) quantizes the decoder's linears and leaves the token
// embeddings and lm_head in 16 bits. Those two are 2 x V x H weights: 19% of a 350M Llama with
// a 32k vocabulary, 13% of Llama 3.2 3B (128k, tied: one table), 1 GiB each in bf16 for Llama 3
// 8B. params.quantize_embeddings holds them in the same format as the linears: the embedding's
// forward dequantizes only the rows it looks up (dequantize_rows), and the head dequantizes per
// call like any quantized linear (quantized_linear; loss_sum dequantizes the [V, H] matrix once
// for its chunked cross-entropy, which reads it chunk after chunk). Both are frozen, as with any
// quantized weight: LoRA trains adapters, none on the embeddings. The cost is accuracy at the
// head: NF4's error (<= 0.152 x a block's absmax per weight) reaches every logit.
int LlamaForCausalLMImpl::quantize_embeddings(const QuantOptions& options) {
  int n = 0;
  if (!model->embed_tokens->base_quantized()) {
    model->embed_tokens->quantize_base(options);
    ++n;
  }
  if (!lm_head.is_empty() && !lm_head->base_quantized()) {
    lm_head->quantize_base(options);
    ++n;
  }
  return n;
}

std::vector<std::shared_ptr<torch::nn::Module>> LlamaForCausalLMImpl::hooked_layers() {
  auto out = model->hooked_layers();
  if (!lm_head.is_empty()) out.push_back(lm_head.ptr());
  return out;
}

void LlamaForCausalLMImpl::set_layer_hooks(LayerHooks* hooks) {
  HookedLayers::set_layer_hooks(hooks);
  model->set_layer_hooks(hooks);
}

// ---------------------------------------------------------------------------------------
// Losses

TokenLoss causal_lm_loss_sum(const torch::Tensor& logits, const torch::Tensor& labels,
                             const torch::Tensor& segment_ids) {
  if (logits.dim() != 3) fail("causal_lm_loss: logits must be [batch, seq, vocab], got {}", c10::str(logits.sizes()));
  if (labels.sizes() != logits.sizes().slice(0, 2)) {
    fail("causal_lm_loss: labels shape {} does not match logits {}", c10::str(labels.sizes()),
         c10::str(logits.sizes()));
  }
  const int64_t V = logits.size(2);
  auto flat_targets = causal_lm_targets(labels, segment_ids).view({-1});
  // One kernel each way, from the logits' own dtype (Note [fused kernels]).
  auto sum = fused_kernels_for(logits)
                 ? fused_cross_entropy_sum(logits.reshape({-1, V}), flat_targets)
                 : torch::nn::functional::cross_entropy(
                       logits.to(torch::kFloat32).reshape({-1, V}), flat_targets,
                       torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
  return {sum, (flat_targets != -100).sum()};
}

torch::Tensor causal_lm_targets(const torch::Tensor& labels, const torch::Tensor& segment_ids) {
  const int64_t B = labels.size(0), T = labels.size(1);
  // ForCausalLMLoss: pad labels with -100 on the right and shift left by one, so that
  // position t is scored against token t + 1 and the last position against nothing.
  auto targets = torch::full({B, T}, -100, labels.options().dtype(torch::kInt64));
  if (T > 1) {
    auto next = labels.narrow(1, 1, T - 1).to(torch::kInt64);
    if (segment_ids.defined()) {
      auto same = segment_ids.narrow(1, 1, T - 1) == segment_ids.narrow(1, 0, T - 1);
      next = torch::where(same, next, torch::full_like(next, -100));
    }
    targets.narrow(1, 0, T - 1).copy_(next);
  }
  return targets;
}

torch::Tensor causal_lm_loss(const torch::Tensor& logits, const torch::Tensor& labels,
                             const torch::Tensor& segment_ids) {
  auto parts = causal_lm_loss_sum(logits, labels, segment_ids);
  return parts.sum / parts.count.clamp_min(1).to(torch::kFloat32);
}

double mean_token_loss(LlamaForCausalLM& model, const std::vector<std::vector<int32_t>>& samples,
                       const std::vector<std::vector<uint8_t>>* loss_mask) {
  if (loss_mask && loss_mask->size() != samples.size()) {
    fail("mean_token_loss: {} loss masks for {} samples", loss_mask->size(), samples.size());
  }
  const bool was_training = model->is_training();
  model->eval();
  torch::NoGradGuard no_grad;
  const auto device = model->model->embed_tokens->device();
  double total = 0.0;
  int64_t count = 0;
  try {
    for (size_t i = 0; i < samples.size(); ++i) {
      const auto& ids = samples[i];
      if (loss_mask && (*loss_mask)[i].size() != ids.size()) {
        fail("mean_token_loss: sample {} has {} tokens but its loss mask has {}", i, ids.size(),
             (*loss_mask)[i].size());
      }
      if (ids.size() < 2) continue;  // nothing to predict
      const int64_t n = static_cast<int64_t>(ids.size());
      auto input = torch::from_blob(const_cast<int32_t*>(ids.data()), {1, n}, torch::kInt32).to(device, torch::kInt64);
      for (int32_t id : ids) {
        if (id < 0 || id >= model->config().vocab_size) {
          fail("mean_token_loss: sample {} has token id {}, out of range for vocab_size {}", i, id,
               model->config().vocab_size);
        }
      }
      // Log-probabilities in fp32 of tokens 1..n-1 given their prefixes.
      auto logits = model->forward(input).to(torch::kFloat32)[0];           // [n, V]
      auto logp = torch::log_softmax(logits.narrow(0, 0, n - 1), -1);        // [n-1, V]
      auto target = input[0].narrow(0, 1, n - 1);
      auto nll = -logp.gather(1, target.unsqueeze(1)).squeeze(1).to(torch::kFloat64).cpu();  // [n-1]
      auto acc = nll.accessor<double, 1>();
      for (int64_t t = 1; t < n; ++t) {
        if (loss_mask && !(*loss_mask)[i][t]) continue;
        total += acc[t - 1];
        ++count;
      }
    }
  } catch (...) {
    model->train(was_training);
    throw;
  }
  model->train(was_training);
  if (count == 0) fail("mean_token_loss: no token to predict ({} samples, all shorter than 2 tokens or masked out)",
                       samples.size());
  return total / static_cast<double>(count);
}

}  // namespace replica::models
