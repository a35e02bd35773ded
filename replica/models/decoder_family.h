// The decoder families replica runs, as a small table of switches (in the spirit of
// torchtitan's model specs): one decoder implementation (llama.h) parameterised by them, not a
// copy of the network per family. Each switch names the transformers code it mirrors.
//
//   model_type   norm weight     block layout                  q/k norm          MLP act   extras
//   llama        w * cast(x^)    pre-norm                      -                 SiLU      llama3 rope_scaling
//   mistral      w * cast(x^)    pre-norm                      -                 SiLU      sliding_window on every layer
//   qwen2        w * cast(x^)    pre-norm                      -                 SiLU      q/k/v bias; use_sliding_window
//   qwen3        w * cast(x^)    pre-norm                      per head          SiLU      use_sliding_window
//   olmo2        cast(w * x^)    post-norm (after attn, MLP)   whole projection  SiLU      rotary in fp32
//   olmo3        cast(w * x^)    post-norm                     whole projection  SiLU      + layer_types: sliding layers
//                                                                                          with plain (default) rope
//   gemma3_text  cast(x^(1+w))   sandwich (before and after)   per head          GELU-tanh embeddings * sqrt(hidden),
//                                                                                          query_pre_attn_scalar, local
//                                                                                          rope base on sliding layers,
//                                                                                          final_logit_softcapping
//   gpt_oss      cast(w * x^)    pre-norm                      -                 (experts) mixture-of-experts MLP
//                                                                                          (moe.h), attention sinks, q/k/v/o
//                                                                                          bias, YaRN, alternating sliding
//                                                                                          layers; MXFP4 experts dequantized
//   gemma3       the text part of Gemma3ForConditionalGeneration (text_config; language_model.*
//                weights); the vision tower and the multimodal projector are not loaded.
//
// x^ = x / rms(x) computed in fp32. "pre-norm": x + attn(norm(x)), then h + mlp(norm(h))
// (Llama's norms are input_layernorm and post_attention_layernorm, the latter before the MLP);
// "post-norm": x + norm(attn(x)), then h + norm(mlp(h)) (post_attention_layernorm,
// post_feedforward_layernorm); "sandwich": x + norm(attn(norm(x))), then h + norm(mlp(norm(h)))
// (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
// post_feedforward_layernorm).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace replica::models {

struct LlamaConfig;

// How an RMSNorm applies its weight to the normalised fp32 input x^.
enum class NormStyle {
  kWeightAfterCast,   // LlamaRMSNorm: weight * x^.to(input dtype)
  kWeightBeforeCast,  // Olmo2RMSNorm / Olmo3RMSNorm: (weight * x^).to(input dtype)
  kOnePlusWeight,     // Gemma3RMSNorm: (x^ * (1 + weight.float())).to(input dtype); weight starts at 0
};

// Where a decoder layer's norms sit (see the table above).
enum class BlockLayout { kPreNorm, kPostNorm, kSandwich };

// q_norm / k_norm: none, over each head's vector (Qwen3, Gemma 3: weight [head_dim]), or over
// the whole q / k projection before it is split into heads (Olmo 2/3: weight [heads * head_dim]).
enum class QkNorm { kNone, kPerHead, kWholeProjection };

enum class Activation { kSilu, kGeluTanh };  // SiLU; gelu_pytorch_tanh (GELU, tanh approximation)

struct FamilySpec {
  const char* model_type;
  const char* architecture;  // the *ForCausalLM class transformers builds for it
  NormStyle norm_style;
  BlockLayout block_layout;
  QkNorm qk_norm;
  Activation activation;
  bool scale_embeddings;  // embeddings times sqrt(hidden_size) in the weight dtype (Gemma3TextScaledWordEmbedding)
  bool rope_in_fp32;      // cos/sin stay fp32 and q, k rotate in fp32, cast back (Olmo 2/3)
};

// The spec of a model_type (replica::Error naming `source` and the supported types otherwise).
// "gemma3" gives gemma3_text's spec: replica loads its text part.
const FamilySpec& family_spec(const std::string& model_type, const std::string& source);
// "llama, mistral, qwen2, qwen3, olmo2, olmo3, gemma3_text, gemma3".
std::string supported_model_types();

// A gemma3 (Gemma3ForConditionalGeneration) config.json: the text model's config, as
// transformers' Gemma3ForCausalLM would read it (text_config, with model_type gemma3_text,
// architectures Gemma3ForCausalLM and the top level's dtype and token ids where the text
// config lacks them). Any other config is returned unchanged. `wrapper` is set to "gemma3"
// when unwrapped, "" otherwise.
nlohmann::json text_model_config(const nlohmann::json& config, std::string* wrapper);

// The constructor defaults of the config class where save_pretrained leaves fields equal to
// them out (gpt_oss: GptOssConfig's, including its YaRN rope_scaling), filled into `j`.
void fill_family_defaults(nlohmann::json& j, const std::string& model_type);

// The family-specific fields of config.json into `c` (whose model_type, sizes and head_dim are
// parsed): switches from the spec, sliding-window layers (layer_types, sliding_window,
// use_sliding_window / max_window_layers, Olmo 3's and Gemma 3's default patterns), Gemma 3's
// query_pre_attn_scalar, rope_local_base_freq and softcapping; refuses what is not supported
// (use_bidirectional_attention, attn_logit_softcapping) naming `source`.
void parse_family_fields(const nlohmann::json& j, const std::string& source, LlamaConfig& c);

// The parameter name of a checkpoint tensor for a model loaded from a config whose wrapper is
// `wrapper` (text_model_config): for gemma3, language_model.model.X (save_pretrained's and the
// Hub's layout) and model.language_model.X (transformers 5) -> model.X, language_model.lm_head.X
// -> lm_head.X, and "" for the vision tower and projector (not loaded). Other names unchanged.
std::string text_parameter_name(const std::string& checkpoint_name, const std::string& wrapper);

// One line for logs: "olmo3 (Olmo3ForCausalLM): 4 layers, hidden 64, 3 of them sliding-window
// (16 tokens)", and for a gemma3 checkpoint that its text model is what is loaded.
std::string describe_model(const LlamaConfig& c);

}  // namespace replica::models
