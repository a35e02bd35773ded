// The family table and the family-specific fields of config.json. Defaults are those of the
// transformers 4.57 config classes (Olmo2Config, Olmo3Config, Gemma3TextConfig), since a field
// equal to its default may be absent from a saved config.json.
#include "replica/models/decoder_family.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/models/config_json.h"
#include "replica/models/llama.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace replica::models {
namespace {

using namespace config_json;

constexpr FamilySpec kFamilies[] = {
    // model_type, architecture, norm weight, layout, q/k norm, activation, scale embeddings, rope in fp32
    {"llama", "LlamaForCausalLM", NormStyle::kWeightAfterCast, BlockLayout::kPreNorm, QkNorm::kNone,
     Activation::kSilu, false, false},
    {"mistral", "MistralForCausalLM", NormStyle::kWeightAfterCast, BlockLayout::kPreNorm, QkNorm::kNone,
     Activation::kSilu, false, false},
    {"qwen2", "Qwen2ForCausalLM", NormStyle::kWeightAfterCast, BlockLayout::kPreNorm, QkNorm::kNone,
     Activation::kSilu, false, false},
    {"qwen3", "Qwen3ForCausalLM", NormStyle::kWeightAfterCast, BlockLayout::kPreNorm, QkNorm::kPerHead,
     Activation::kSilu, false, false},
    {"olmo2", "Olmo2ForCausalLM", NormStyle::kWeightBeforeCast, BlockLayout::kPostNorm, QkNorm::kWholeProjection,
     Activation::kSilu, false, true},
    {"olmo3", "Olmo3ForCausalLM", NormStyle::kWeightBeforeCast, BlockLayout::kPostNorm, QkNorm::kWholeProjection,
     Activation::kSilu, false, true},
    {"gemma3_text", "Gemma3ForCausalLM", NormStyle::kOnePlusWeight, BlockLayout::kSandwich, QkNorm::kPerHead,
     Activation::kGeluTanh, true, false},
    // GPT-OSS: GptOssRMSNorm is (weight * x^).to(dtype); its MLP is a mixture of experts and its
    // attention has sinks (parse_family_fields sets those).
    {"gpt_oss", "GptOssForCausalLM", NormStyle::kWeightBeforeCast, BlockLayout::kPreNorm, QkNorm::kNone,
     Activation::kSilu, false, false},
};

// GptOssConfig's constructor defaults (gpt-oss-20b's shape).
const json& gpt_oss_defaults() {
  static const json d = {{"vocab_size", 201088},
                         {"hidden_size", 2880},
                         {"intermediate_size", 2880},
                         {"num_hidden_layers", 36},
                         {"num_attention_heads", 64},
                         {"num_key_value_heads", 8},
                         {"head_dim", 64},
                         {"num_local_experts", 128},
                         {"num_experts_per_tok", 4},
                         {"sliding_window", 128},
                         {"rope_theta", 150000.0},
                         {"max_position_embeddings", 131072},
                         {"rms_norm_eps", 1e-5},
                         {"attention_bias", true},
                         {"tie_word_embeddings", false},
                         {"router_aux_loss_coef", 0.9},
                         {"output_router_logits", false},
                         {"rope_scaling",
                          {{"rope_type", "yarn"},
                           {"factor", 32.0},
                           {"beta_fast", 32.0},
                           {"beta_slow", 1.0},
                           {"truncate", false},
                           {"original_max_position_embeddings", 4096}}}};
  return d;
}

// The constructor defaults of the fields a saved config.json may leave out.
const json& olmo_defaults() {
  static const json d = {{"vocab_size", 50304},  {"hidden_size", 4096},      {"intermediate_size", 11008},
                         {"num_hidden_layers", 32}, {"num_attention_heads", 32}, {"hidden_act", "silu"},
                         {"max_position_embeddings", 2048}, {"pad_token_id", 1}, {"eos_token_id", 50279},
                         {"tie_word_embeddings", false}, {"rope_theta", 10000.0}, {"attention_bias", false},
                         {"rms_norm_eps", 1e-5}};
  return d;
}

const json& gemma3_text_defaults() {
  static const json d = {{"vocab_size", 262208},
                         {"hidden_size", 2304},
                         {"intermediate_size", 9216},
                         {"num_hidden_layers", 26},
                         {"num_attention_heads", 8},
                         {"num_key_value_heads", 4},
                         {"head_dim", 256},
                         {"hidden_activation", "gelu_pytorch_tanh"},
                         {"max_position_embeddings", 131072},
                         {"rms_norm_eps", 1e-6},
                         {"pad_token_id", 0},
                         {"eos_token_id", 1},
                         {"bos_token_id", 2},
                         {"tie_word_embeddings", true},
                         {"rope_theta", 1000000.0},
                         {"attention_bias", false},
                         {"query_pre_attn_scalar", 256},
                         {"sliding_window", 4096},
                         {"rope_local_base_freq", 10000.0},
                         {"use_bidirectional_attention", false}};
  return d;
}

Activation parse_activation(const json& j, const char* key, const char* def, const std::string& source) {
  const std::string act = optional_string(j, key, source).value_or(def);
  if (act == "silu") return Activation::kSilu;
  if (act == "gelu_pytorch_tanh") return Activation::kGeluTanh;
  fail("{}: {} {} is not supported (silu, gelu_pytorch_tanh)", source, key, quote_excerpt(act));
}

// layer_types as written, checked: one entry per layer, each full_attention or sliding_attention.
std::optional<std::vector<bool>> parse_layer_types(const json& j, int64_t layers, const std::string& source) {
  const json* types = field(j, "layer_types");
  if (!types) return std::nullopt;
  if (!types->is_array()) fail("{}: layer_types must be a list, got {}", source, json_excerpt(*types));
  std::vector<bool> sliding;
  for (const auto& t : *types) {
    if (!t.is_string()) fail("{}: layer_types must list strings, got {}", source, json_excerpt(t));
    const std::string kind = t.get<std::string>();
    if (kind != "sliding_attention" && kind != "full_attention") {
      fail("{}: layer_types entry {} is not supported (full_attention, sliding_attention)", source,
           quote_excerpt(kind));
    }
    sliding.push_back(kind == "sliding_attention");
  }
  if (static_cast<int64_t>(sliding.size()) != layers) {
    fail("{}: layer_types lists {} layers but num_hidden_layers is {}", source, sliding.size(), layers);
  }
  return sliding;
}

}  // namespace

void fill_family_defaults(nlohmann::json& j, const std::string& model_type) {
  if (model_type != "gpt_oss") return;
  for (const auto& [key, value] : gpt_oss_defaults().items()) {
    if (!j.contains(key)) j[key] = value;
  }
}

const FamilySpec& family_spec(const std::string& model_type, const std::string& source) {
  const std::string type = model_type == "gemma3" ? "gemma3_text" : model_type;
  for (const auto& f : kFamilies) {
    if (type == f.model_type) return f;
  }
  fail("{}: model_type {} is not supported (supported: {})", source, quote_excerpt(model_type),
       supported_model_types());
}

std::string supported_model_types() {
  std::string out;
  for (const auto& f : kFamilies) out += std::string(out.empty() ? "" : ", ") + f.model_type;
  return out + ", gemma3";
}

nlohmann::json text_model_config(const nlohmann::json& config, std::string* wrapper) {
  if (wrapper) wrapper->clear();
  if (!config.is_object() || config.value("model_type", json()) != json("gemma3")) return config;
  // Gemma3ForConditionalGeneration: its text model is a Gemma3TextModel built from text_config
  // (what Gemma3ForCausalLM.from_pretrained on the same directory reads, via base_config_key).
  json text = config.contains("text_config") && config["text_config"].is_object() ? config["text_config"]
                                                                                   : json::object();
  text["model_type"] = "gemma3_text";
  text["architectures"] = json::array({"Gemma3ForCausalLM"});
  for (const char* key : {"torch_dtype", "dtype", "bos_token_id", "eos_token_id", "quantization_config"}) {
    if (config.contains(key) && !text.contains(key)) text[key] = config[key];
  }
  if (!text.contains("tie_word_embeddings") && config.contains("tie_word_embeddings")) {
    text["tie_word_embeddings"] = config["tie_word_embeddings"];
  }
  if (wrapper) *wrapper = "gemma3";
  return text;
}

void parse_family_fields(const nlohmann::json& file_json, const std::string& source, LlamaConfig& c) {
  const FamilySpec& spec = family_spec(c.model_type, source);
  json j = file_json;
  const bool olmo = c.model_type == "olmo2" || c.model_type == "olmo3";
  const bool gemma = c.model_type == "gemma3_text";
  const bool gpt_oss = c.model_type == "gpt_oss";
  fill_family_defaults(j, c.model_type);
  if (olmo || gemma) {
    for (const auto& [key, value] : (gemma ? gemma3_text_defaults() : olmo_defaults()).items()) {
      if (!j.contains(key)) j[key] = value;
    }
    if (c.model_type == "olmo3" && !j.contains("sliding_window")) j["sliding_window"] = 4096;
  }
  c.norm_style = spec.norm_style;
  c.block_layout = spec.block_layout;
  c.qk_norm = spec.qk_norm;
  c.scale_embeddings = spec.scale_embeddings;
  c.rope_in_fp32 = spec.rope_in_fp32;
  // The activation: Gemma3MLP reads hidden_activation, every other family hidden_act.
  c.activation = gemma ? parse_activation(j, "hidden_activation", "gelu_pytorch_tanh", source)
                       : parse_activation(j, "hidden_act", "silu", source);
  if (!gemma) {
    if (auto act = optional_string(j, "hidden_activation", source); act && *act != "silu") {
      fail("{}: hidden_activation {} is not supported for {} (only silu)", source, quote_excerpt(*act),
           c.model_type);
    }
  }
  if (gpt_oss) {
    // GptOssAttention: bias=config.attention_bias on q, k, v and o; sinks; GptOssMLP.
    c.qkv_bias = c.o_bias = optional_bool(j, "attention_bias", source, true);
    c.attention_sinks = true;
    c.num_local_experts = optional_int(j, "num_local_experts", source, 128, 1, kMaxExperts);
    c.num_experts_per_tok = optional_int(j, "num_experts_per_tok", source, 4, 1, kMaxExperts);
    if (c.num_local_experts < 1 || c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_local_experts) {
      fail("{}: num_experts_per_tok {} must be between 1 and num_local_experts {}", source, c.num_experts_per_tok,
           c.num_local_experts);
    }
    // transformers adds router_aux_loss_coef x the load-balancing loss to the loss when asked.
    c.output_router_logits = optional_bool(j, "output_router_logits", source, false);
    c.router_aux_loss_coef = optional_number(j, "router_aux_loss_coef", source, 0.9);
    if (c.router_aux_loss_coef < 0) fail("{}: router_aux_loss_coef {} must be >= 0", source, c.router_aux_loss_coef);
  }
  if (olmo || gemma) {
    // Olmo2/3Attention, Gemma3Attention: bias=config.attention_bias on q, k, v and o.
    c.qkv_bias = c.o_bias = optional_bool(j, "attention_bias", source, false);
  }

  if (gemma) {
    if (optional_bool(j, "use_bidirectional_attention", source, false)) {
      fail("{}: use_bidirectional_attention true (Gemma 3 embedding models) is not supported: replica trains "
           "causal language models",
           source);
    }
    if (const json* cap = field(j, "attn_logit_softcapping")) {
      fail("{}: attn_logit_softcapping {} is not supported (Gemma 3 checkpoints leave it null; transformers' "
           "default sdpa attention does not apply it either, only its eager path does)",
           source, json_excerpt(*cap));
    }
    c.query_pre_attn_scalar = optional_number(j, "query_pre_attn_scalar", source, 256.0);
    if (*c.query_pre_attn_scalar <= 0) fail("{}: query_pre_attn_scalar must be positive", source);
    c.local_rope_theta = optional_number(j, "rope_local_base_freq", source, 10000.0);
    if (*c.local_rope_theta <= 0) fail("{}: rope_local_base_freq must be positive", source);
    c.final_logit_softcapping = optional_number(j, "final_logit_softcapping", source);
    if (c.final_logit_softcapping && *c.final_logit_softcapping <= 0) {
      fail("{}: final_logit_softcapping must be positive or null", source);
    }
    if (c.final_logit_softcapping && !c.wrapper_model_type.empty()) {
      // Gemma3ForCausalLM caps the logits, Gemma3ForConditionalGeneration (what transformers
      // builds for this checkpoint) does not: the two disagree, so replica takes neither.
      fail("{}: final_logit_softcapping {} in a {} checkpoint is not supported (transformers applies it in "
           "Gemma3ForCausalLM but not in Gemma3ForConditionalGeneration; Gemma 3 checkpoints leave it null)",
           source, *c.final_logit_softcapping, c.wrapper_model_type);
    }
  } else {
    for (const char* key : {"final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar"}) {
      if (field(j, key)) fail("{}: {} is not supported for {}", source, key, c.model_type);
    }
  }

  // Sliding-window attention: which layers slide, and the window (a token attends to itself and
  // the sliding_window - 1 tokens before it, as transformers' sliding_window_overlay).
  const int64_t layers = c.num_hidden_layers;
  std::optional<int64_t> window;
  if (field(j, "sliding_window")) {
    window = as_int(j["sliding_window"], "sliding_window", source);
    if (*window < 1) fail("{}: sliding_window must be at least 1 or null, got {}", source, *window);
  }
  auto types = parse_layer_types(j, layers, source);
  std::vector<bool> sliding;
  if (c.model_type == "mistral") {
    // MistralModel: every layer slides when sliding_window is set (layer_types ignored).
    if (window) sliding.assign(static_cast<size_t>(layers), true);
  } else if (c.model_type == "qwen2" || c.model_type == "qwen3") {
    // Qwen2Config / Qwen3Config: sliding_window only with use_sliding_window; the layers from
    // max_window_layers on slide unless layer_types says otherwise.
    if (optional_bool(j, "use_sliding_window", source, false) && window) {
      if (types) {
        sliding = *types;
      } else {
        const int64_t first = optional_int(j, "max_window_layers", source, 28);
        for (int64_t i = 0; i < layers; ++i) sliding.push_back(i >= first);
      }
    }
  } else if (c.model_type == "olmo3" || gemma || gpt_oss) {
    if (types) {
      sliding = *types;
    } else {
      // Olmo3Config: three sliding layers then one full; Gemma3TextConfig: sliding_window_pattern
      // (default 6) - 1 sliding layers then one full.
      // GptOssConfig: sliding and full layers alternate, starting with a sliding one.
      int64_t pattern = gpt_oss ? 2 : 4;
      if (gemma) {
        pattern = optional_int(j, "sliding_window_pattern", source, optional_int(j, "_sliding_window_pattern", source, 6));
        if (pattern < 1) fail("{}: sliding_window_pattern must be at least 1, got {}", source, pattern);
      }
      for (int64_t i = 0; i < layers; ++i) sliding.push_back((i + 1) % pattern != 0);
    }
    bool any = false;
    for (bool s : sliding) any = any || s;
    if (any && !window) {
      fail("{}: layer_types has sliding_attention layers but sliding_window is null", source);
    }
  }
  // (llama and olmo2 have no sliding-window attention; transformers ignores the fields there.)
  bool any = false;
  for (bool s : sliding) any = any || s;
  if (any) {
    c.sliding_window = window;
    c.sliding_layers = sliding;
  } else {
    c.sliding_window.reset();
    c.sliding_layers.clear();
  }
  // Olmo3Model: sliding layers rotate with plain (default) RoPE on rope_theta, full layers with
  // rope_scaling; without rope_scaling the two are the same.
  if (c.model_type == "olmo3" && c.rope_scaling) c.local_rope_theta = c.rope_theta;
}

std::string describe_model(const LlamaConfig& c) {
  int64_t sliding = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) sliding += c.layer_slides(i) ? 1 : 0;
  std::string out = fmt::format("{} ({}): {} layers, hidden {}", c.model_type,
                                family_spec(c.model_type, "config").architecture, c.num_hidden_layers, c.hidden_size);
  if (sliding > 0) out += fmt::format(", {} of them sliding-window ({} tokens)", sliding, *c.sliding_window);
  if (!c.wrapper_model_type.empty()) {
    out += fmt::format("; the text model of a {} checkpoint (its vision tower and multimodal projector are not "
                       "loaded)",
                       c.wrapper_model_type);
  }
  return out;
}

std::string text_parameter_name(const std::string& name, const std::string& wrapper) {
  if (wrapper.empty()) return name;
  struct Rename {
    const char* from;
    const char* to;
  };
  static const Rename kRenames[] = {{"language_model.model.", "model."},
                                    {"model.language_model.", "model."},
                                    {"language_model.lm_head.", "lm_head."}};
  for (const auto& r : kRenames) {
    if (starts_with(name, r.from)) return r.to + name.substr(std::string(r.from).size());
  }
  for (const char* skipped : {"vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                              "model.multi_modal_projector."}) {
    if (starts_with(name, skipped)) return "";
  }
  return name;
}

}  // namespace replica::models
