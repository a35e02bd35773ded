// LoRA (low-rank adaptation) the way Hugging Face PEFT does it, for any model whose linear
// layers are replica::models::LoraLinear (the Llama family in llama.h is).
//
// A LoRA-adapted linear layer computes
//     y = x W^T + b  +  (dropout(x) A^T B^T) * scaling,     scaling = lora_alpha / r
// (lora_alpha / sqrt(r) with use_rslora), with the base W, b frozen, A [r, in] initialised
// kaiming-uniform(a = sqrt(5)) and B [out, r] zeros, so a fresh adapter changes nothing.
// Dropout is on the LoRA input path only. Like PEFT (autocast_adapter_dtype=True) the
// adapter weights are fp32 even over a bf16 base; the input is cast to their dtype and the
// sum cast back to the base output's dtype. For backward the branch keeps the input (the base
// linear's own tensor) and a one-byte dropout mask, not PEFT's noise and dropped copy (Note
// [LoRA's input path keeps a mask, not copies] in lora.cpp).
//
// Names. Inside the model the adapter weights sit next to the base weight:
//     model.layers.0.self_attn.q_proj.weight          (base, frozen, the HF name)
//     model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
//     model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]
// so the base model's named_parameters() stay the Hugging Face checkpoint names. PEFT's
// adapter_model.safetensors names them with a "base_model.model." prefix (and without the
// adapter name "default"): base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight.
// lora_state_dict() returns exactly those keys; save_adapter()/load_adapter() read and write
// a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that PEFT's
// PeftModel.from_pretrained loads, and that replica loads back from PEFT.
//
// Quantized base (QLoRA). quantize_base_linears() holds the frozen base weight of every linear
// layer inside the decoder layers in NF4 or int8 (models/quant.h) and releases the full-
// precision one; embeddings, lm_head and norms stay as they are, as with bitsandbytes in
// transformers (QuantOptions::embeddings quantizes those two as well: models/llama.h). The adapters stay fp32 and are saved exactly as over an unquantized base: an
// adapter trained over the quantized base loads in PEFT over the unquantized one.
#pragma once

#include "replica/io/safetensors.h"
#include "replica/models/quant.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <vector>

namespace replica::models {

// A linear layer (PyTorch's nn.Linear parameters: weight [out, in], optional bias [out])
// that can carry one LoRA adapter.
class LoraLinearImpl : public torch::nn::Module, public QuantizedWeightHolder {
 public:
  // Parameters are allocated in `dtype` and left uninitialised when init is false (a loader
  // overwrites them); otherwise HF's init: weight ~ N(0, init_std), bias zeros.
  LoraLinearImpl(int64_t in_features, int64_t out_features, bool bias,
                 torch::ScalarType dtype = torch::kFloat32, bool init = true, double init_std = 0.02);

  torch::Tensor forward(const torch::Tensor& x);

  // Adds lora_A / lora_B (fp32, on the base weight's device) and freezes nothing: apply_lora
  // does the freezing for the whole model. replica::Error when an adapter is already there.
  void add_lora(int64_t r, double scaling, double dropout);
  // W += scaling * B @ A (in fp32, rounded once to W's dtype), then removes the adapter.
  // replica::Error over a quantized base (merging belongs on the unquantized weights).
  void merge_lora();
  // Removes the adapter without merging.
  void remove_lora();
  bool has_lora() const { return !lora_A.is_empty(); }

  // Quantizes the base weight (models/quant.h) where it lives and releases the full-precision
  // one: `weight` is no longer a parameter (it becomes undefined), forward dequantizes the codes
  // to the compute dtype on each call, and backward does again (quantized_linear). The bias is
  // kept as it is. replica::Error when the base is already quantized or options are none.
  void quantize_base(const QuantOptions& options);
  bool base_quantized() const override { return quantized_.defined(); }
  const QuantizedTensor& quantized_weight() const override { return quantized_; }
  // The base weight's values: `weight`, or the quantized weight dequantized (a new tensor).
  torch::Tensor base_weight() const;
  // Where the base computes (the weight's, or its codes', device).
  torch::Device device() const;
  // Bytes the base layer holds: the weight (or its codes and statistics) and the bias.
  int64_t base_bytes() const;

  // Module::to, and the quantized weight moves with the module. Its codes keep their integer
  // dtype: to(dtype) only changes the dtype dequantize() gives by default.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  double lora_scaling() const { return scaling_; }
  double lora_dropout() const { return dropout_; }

  torch::Tensor weight;  // undefined once the base is quantized
  torch::Tensor bias;    // undefined when the layer has no bias
  torch::nn::Linear lora_A{nullptr};
  torch::nn::Linear lora_B{nullptr};

 private:
  QuantizedTensor quantized_;
  int64_t in_features_ = 0;
  int64_t out_features_ = 0;
  double scaling_ = 1.0;
  double dropout_ = 0.0;
};
TORCH_MODULE(LoraLinear);

// PEFT's LoraConfig, the fields replica supports.
struct LoraConfig {
  int64_t r = 16;
  double lora_alpha = 32;
  double lora_dropout = 0.05;
  // Module name suffixes (PEFT matching: a module is targeted when its full name equals an
  // entry or ends with "." + entry), or the single entry "all-linear": every linear layer
  // inside the decoder layers (never lm_head). A single entry that is neither a known name
  // nor all-linear is treated like PEFT treats a string: a regex that must match the whole
  // module name (set target_modules_is_regex).
  std::vector<std::string> target_modules = {"all-linear"};
  bool target_modules_is_regex = false;
  bool use_rslora = false;           // scaling = lora_alpha / sqrt(r)
  std::string base_model_name_or_path;
  // What adapter_config.json says the adapter is for: CAUSAL_LM, or SEQ_CLS (a reward model,
  // whose score head is trained whole and saved beside the adapter: modules_to_save).
  std::string task_type = "CAUSAL_LM";
  std::vector<std::string> modules_to_save;

  double scaling() const;
};

// Adds an adapter to every targeted LoraLinear of `model` and freezes every other parameter
// (requires_grad false), as PEFT's get_peft_model does with bias "none". Returns the full
// names of the adapted modules (sorted as in named_modules()). Errors (replica::Error):
// r < 1, dropout outside [0, 1), a target matching nothing, lm_head targeted, adapters present.
// `config.target_modules` is rewritten to the sorted list of module-name suffixes that were
// adapted when it was "all-linear". PEFT 0.21 saves the expanded list too, as full module names
// (condensed to suffixes from 20 modules on); both forms load either way (peft_conformance_test).
std::vector<std::string> apply_lora(torch::nn::Module& model, LoraConfig& config);

// Adapter tensors under PEFT's saved names (base_model.model.<name>), in model order.
io::NamedTensors lora_state_dict(const torch::nn::Module& model);
// PEFT's saved name of a model parameter that is an adapter weight (NAME.lora_A.weight or
// NAME.lora_B.weight, as named_parameters() spells it), or "" for any other parameter.
std::string peft_adapter_key(const std::string& parameter_name);
// The trainable adapter parameters under PEFT's names (same tensors, for optimisers).
std::vector<std::pair<std::string, torch::Tensor>> lora_named_parameters(const torch::nn::Module& model);
// Copies PEFT-named tensors into the model's adapters; every adapter weight must be given and
// every given tensor must name one, with the right shape (replica::Error naming it otherwise).
// `source` names the file in errors.
void load_lora_state_dict(torch::nn::Module& model, const io::NamedTensors& tensors,
                          const std::string& source = "adapter");

// Writes DIR/adapter_config.json (PEFT's layout, inference_mode true) and
// DIR/adapter_model.safetensors (fp32 as trained; atomic writes). Creates DIR. `extra`: further
// tensors of the file under their PEFT names (modules_to_save: base_model.model.score.weight).
void save_adapter(const torch::nn::Module& model, const LoraConfig& config, const std::string& dir,
                  const io::NamedTensors& extra = {});
// Reads DIR/adapter_config.json; replica::Error naming the file and the field for what
// replica does not support (peft_type other than LORA, task_type other than CAUSAL_LM and
// SEQ_CLS (whose modules_to_save is the score head), use_dora, other modules_to_save,
// rank_pattern/alpha_pattern, layers_to_transform, bias other than none, fan_in_fan_out...).
LoraConfig read_adapter_config(const std::string& dir);
// read_adapter_config + apply_lora + load_lora_state_dict from DIR/adapter_model.safetensors.
// A SEQ_CLS adapter (a reward model's) also saves modules whole (its score head): they are
// handed to *saved_modules under the model's names (score.weight); without it, such an
// adapter is refused.
LoraConfig load_adapter(torch::nn::Module& model, const std::string& dir, io::NamedTensors* saved_modules = nullptr);

// Folds every adapter into its base weight (W += scaling * B @ A) and removes the adapters;
// returns how many were merged. Base parameters stay frozen (requires_grad unchanged).
// replica::Error naming the layer when its base is quantized.
int merge_lora(torch::nn::Module& model);
// While one lives, on this thread, every LoraLinear computes its base layer alone: PEFT's
// disable_adapter(), which DPO's reference model is under peft (the frozen base without a
// second copy in memory).
class AdaptersDisabled {
 public:
  AdaptersDisabled();
  ~AdaptersDisabled();
  AdaptersDisabled(const AdaptersDisabled&) = delete;
  AdaptersDisabled& operator=(const AdaptersDisabled&) = delete;
  static bool active();
};

// True when any LoraLinear of `model` carries an adapter.
bool has_lora(const torch::nn::Module& model);

// The linear layers QLoRA quantizes: every LoraLinear inside the decoder layers (never lm_head,
// nor the embeddings and norms, which are not LoraLinear), with its full name.
std::vector<std::pair<std::string, std::shared_ptr<LoraLinearImpl>>> quantizable_linears(const torch::nn::Module& model);
// Quantizes the base of every quantizable linear that is not quantized yet (quantize_base) and
// returns their names. Adapters, present or added later, are not touched.
std::vector<std::string> quantize_base_linears(torch::nn::Module& model, const QuantOptions& options);
// True when any module of `model` (a LoraLinear, the token embedding: QuantizedWeightHolder)
// holds a quantized weight.
bool has_quantized_base(const torch::nn::Module& model);

// What the frozen base holds (adapter weights excluded): every other parameter and buffer, and
// the quantized weights' codes and statistics, against the same weights in fp16.
struct BaseMemory {
  int64_t bytes = 0;                 // as held
  int64_t fp16_bytes = 0;            // every base weight at 2 bytes
  int64_t quantized_bytes = 0;       // the quantized weights' codes and statistics
  int64_t quantized_fp16_bytes = 0;  // those weights at 2 bytes
  int quantized_layers = 0;          // modules holding a quantized weight
};
BaseMemory base_memory(const torch::nn::Module& model);

}  // namespace replica::models
