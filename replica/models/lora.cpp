// LoRA as PEFT implements it (peft/tuners/lora/layer.py: Linear.update_layer, forward,
// get_delta_weight, merge), and PEFT's adapter directory layout.
#include "replica/models/lora.h"

#include "replica/models/linear.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/io/files.h"
#include "replica/models/config_json.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <unistd.h>

namespace replica::models {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// PEFT's saved names: the PeftModel wraps the model as base_model (LoraModel) -> model.
constexpr const char* kPeftPrefix = "base_model.model.";

std::string last_component(const std::string& name) {
  auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

bool in_decoder_layers(const std::string& name) {
  return name.rfind("layers.", 0) == 0 || name.find(".layers.") != std::string::npos;
}

// Every LoraLinear of the model with its full name, in registration order.
std::vector<std::pair<std::string, std::shared_ptr<LoraLinearImpl>>> lora_linears(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<LoraLinearImpl>>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto layer = std::dynamic_pointer_cast<LoraLinearImpl>(item.value())) out.emplace_back(item.key(), layer);
  }
  return out;
}


// Note [LoRA's input path keeps a mask, not copies]
// PEFT's branch, lora_B(lora_A(dropout(x.to(fp32)))), leaves autograd holding for each adapted
// linear the dropout's fp32 noise (for the input's gradient) and the dropped fp32 input (for A's
// gradient; under bf16 autocast its bf16 cast; without dropout, x's fp32 or bf16 copy): 5 to 8
// bytes per input element, seven times per decoder layer, while the base linear holds x already.
// In the layer being recomputed under activation checkpointing that is ~124 MiB on a 349M Llama
// shape at 2,048 tokens in fp32 and ~350 MiB at hidden 4096 in bf16, all alive at the peak.
// LoraDown computes lora_A(dropout(x)) with the same random draws as ATen's dropout (on the CPU
// an fp32 bernoulli_(1 - p) noise divided by 1 - p; on CUDA native_dropout), and keeps only x (the
// base linear's tensor: no new bytes) and the one-byte keep mask; backward rebuilds the dropped
// input from them (one pass over x) and scales the input's gradient in place. The products run
// in the dtype autocast gives them (bf16 under bf16 autocast, as nn.Linear would), through
// models::linear's fp32 GEMM on CPUs without bf16 arithmetic. Values: the dropped input equals
// ATen's where kept (dropped elements are +0 where ATen's product gives -0 for a negative
// input); the products agree to float rounding.

// t times ATen's dropout noise for the mask `keep` (true: kept), into t's own storage where
// `in_place`. On CUDA native_dropout's backward; on the CPU ATen's noise holds 0 and
// 1.0f / (1 - p) (bernoulli_, then div_), so t times it is t times that float where kept and 0
// elsewhere, computed without a float copy of the mask (the backward's transient memory).
torch::Tensor dropout_scale(torch::Tensor t, const torch::Tensor& keep, double p, bool in_place) {
  if (t.is_cuda()) return at::native_dropout_backward(t, keep, 1.0 / (1.0 - p));
  const float kept = 1.0f / static_cast<float>(1.0 - p);
  auto out = in_place ? t.mul_(kept) : t * kept;
  return out.masked_fill_(keep.logical_not(), 0.0);
}

class LoraDown : public torch::autograd::Function<LoraDown> {
 public:
  // x [..., in], a = lora_A.weight [r, in]; p: the dropout probability (0: none).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& a,
                               double p) {
    auto h = x.to(a.scalar_type());
    torch::Tensor keep;
    if (p > 0) {
      if (h.is_cuda()) {
        std::tie(h, keep) = at::native_dropout(h, p, /*train=*/true);
      } else {
        auto noise = at::empty_like(h).bernoulli_(1.0 - p);
        keep = noise.to(torch::kBool);
        h = h * noise.div_(1.0 - p);
      }
    }
    auto out = models::linear(h, a);  // under autocast: its dtype's product, as lora_A(h)
    ctx->save_for_backward({x, a, keep});
    ctx->saved_data["p"] = p;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &a = saved[1], &keep = saved[2];
    const double p = ctx->saved_data["p"].toDouble();
    const int64_t r = a.size(0), in = a.size(1);
    const auto compute = grads[0].scalar_type();  // the forward product's dtype
    auto grad = grads[0].reshape({-1, r});
    torch::Tensor grad_x, grad_a;
    if (ctx->needs_input_grad(1)) {
      auto h = x.to(a.scalar_type());
      if (p > 0) h = dropout_scale(h, keep, p, /*in_place=*/!h.is_same(x));  // x itself in fp32: never written
      grad_a = dtype_matmul(grad.t(), h.reshape({-1, in}).to(compute)).to(a.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      auto g = dtype_matmul(grad, a.to(compute)).to(a.scalar_type());
      if (p > 0) g = dropout_scale(g, keep.reshape({-1, in}), p, /*in_place=*/true);
      grad_x = g.to(x.scalar_type()).reshape(x.sizes());
    }
    return {grad_x, grad_a, torch::Tensor()};
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------

LoraLinearImpl::LoraLinearImpl(int64_t in_features, int64_t out_features, bool with_bias,
                               torch::ScalarType dtype, bool init, double init_std)
    : in_features_(in_features), out_features_(out_features) {
  if (in_features < 1 || out_features < 1) {
    fail("LoraLinear: sizes must be at least 1, got in {} out {}", in_features, out_features);
  }
  weight = register_parameter("weight", torch::empty({out_features, in_features}, torch::dtype(dtype)));
  if (with_bias) bias = register_parameter("bias", torch::empty({out_features}, torch::dtype(dtype)));
  if (init) {
    torch::NoGradGuard no_grad;
    weight.normal_(0.0, init_std);
    if (with_bias) bias.zero_();
  }
}

torch::Tensor LoraLinearImpl::forward(const torch::Tensor& x) {
  // The frozen base layer: x W^T + b (W dequantized for this call when it is held quantized).
  auto result = quantized_.defined() ? quantized_linear(x, quantized_, bias) : models::linear(x, weight, bias);
  if (lora_A.is_empty() || AdaptersDisabled::active()) return result;
  // PEFT Linear.forward: the LoRA branch runs in the adapter's dtype on the (dropped-out)
  // input, scaled, added, and the sum cast back to the base output's dtype.
  // Note [LoRA's input path keeps a mask, not copies]: lora_A(dropout(x)) saving x and a mask.
  const auto result_dtype = result.scalar_type();
  const double p = dropout_ > 0 && is_training() ? dropout_ : 0.0;
  auto down = LoraDown::apply(x, lora_A->weight, p);
  result = result + models::linear(down, lora_B->weight) * scaling_;
  return result.to(result_dtype);
}

void LoraLinearImpl::add_lora(int64_t r, double scaling, double dropout) {
  if (!lora_A.is_empty()) fail("LoraLinear: an adapter is already attached");
  if (r < 1) fail("LoRA: r must be at least 1, got {}", r);
  const auto options = torch::TensorOptions().dtype(torch::kFloat32).device(device());
  // update_layer + reset_lora_parameters(init_lora_weights=True): A kaiming-uniform with
  // a = sqrt(5) (nn.Linear's default), B zeros, so the adapter starts as the identity.
  lora_A = register_module("lora_A", torch::nn::Linear(torch::nn::LinearOptions(in_features_, r).bias(false)));
  lora_B = register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(r, out_features_).bias(false)));
  lora_A->to(options.device());
  lora_B->to(options.device());
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(lora_A->weight, std::sqrt(5.0));
  lora_B->weight.zero_();
  scaling_ = scaling;
  dropout_ = dropout;
}

void LoraLinearImpl::merge_lora() {
  if (lora_A.is_empty()) return;
  if (quantized_.defined()) {
    // PEFT re-quantizes after merging, which adds a second rounding to the delta; replica merges
    // where the weights are exact: the unquantized base read again from its directory.
    fail("LoraLinear: the base weight is quantized ({}); merge the adapter into the unquantized base "
         "(replica merge-adapter --model BASE --adapter DIR, or merge_adapter: true)",
         quantized_.kind == QuantKind::Nf4 ? "nf4" : "int8");
  }
  torch::NoGradGuard no_grad;
  // get_delta_weight: (B @ A) * scaling, in fp32; W + delta rounded once to W's dtype.
  auto delta = torch::matmul(lora_B->weight.to(torch::kFloat32), lora_A->weight.to(torch::kFloat32)) * scaling_;
  weight.copy_(weight.to(torch::kFloat32) + delta.to(weight.device()));
  remove_lora();
}

void LoraLinearImpl::remove_lora() {
  if (lora_A.is_empty()) return;
  unregister_module("lora_A");
  unregister_module("lora_B");
  lora_A = nullptr;
  lora_B = nullptr;
}

void LoraLinearImpl::quantize_base(const QuantOptions& options) {
  if (quantized_.defined()) fail("LoraLinear: the base weight is already quantized");
  if (!options.enabled()) fail("LoraLinear: quantize_base needs a quantization (int4 or int8), got none");
  quantized_ = quantize(weight, options);
  // Release the full-precision weight: no longer a parameter (nothing sees, broadcasts, steps or
  // saves it), and the module's handle gone, so its memory is freed once the caller's is.
  parameters_.erase("weight");
  weight = torch::Tensor();
}

torch::Tensor LoraLinearImpl::base_weight() const {
  return quantized_.defined() ? dequantize(quantized_) : weight;
}

torch::Device LoraLinearImpl::device() const {
  return quantized_.defined() ? quantized_.device() : weight.device();
}

int64_t LoraLinearImpl::base_bytes() const {
  int64_t n = quantized_.defined() ? quantized_.bytes() : weight.numel() * static_cast<int64_t>(weight.element_size());
  if (bias.defined()) n += bias.numel() * static_cast<int64_t>(bias.element_size());
  return n;
}

void LoraLinearImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, dtype, non_blocking);
  follow_module_to(quantized_, device, dtype, non_blocking);
}

void LoraLinearImpl::to(torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(dtype, non_blocking);
  follow_module_to(quantized_, std::nullopt, dtype, non_blocking);
}

void LoraLinearImpl::to(torch::Device device, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  follow_module_to(quantized_, device, std::nullopt, non_blocking);
}

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / static_cast<double>(r);
}

// ---------------------------------------------------------------------------------------

std::vector<std::string> apply_lora(torch::nn::Module& model, LoraConfig& config) {
  if (config.r < 1) fail("LoRA: r must be at least 1, got {}", config.r);
  if (!(config.lora_dropout >= 0 && config.lora_dropout < 1)) {
    fail("LoRA: lora_dropout must be in [0, 1), got {}", config.lora_dropout);
  }
  if (config.target_modules.empty()) fail("LoRA: target_modules is empty");
  if (has_lora(model)) fail("LoRA: the model already has adapters");

  const auto layers = lora_linears(model);
  const bool all_linear = !config.target_modules_is_regex && config.target_modules.size() == 1 &&
                          config.target_modules[0] == "all-linear";
  std::optional<std::regex> pattern;
  if (config.target_modules_is_regex) {
    if (config.target_modules.size() != 1) fail("LoRA: a regex target_modules must be a single string");
    try {
      pattern.emplace(config.target_modules[0]);
    } catch (const std::regex_error& e) {
      fail("LoRA: target_modules regex '{}' is invalid: {}", config.target_modules[0], e.what());
    }
  }
  auto matches = [&](const std::string& name, const std::string& target) {
    return name == target || ends_with(name, "." + target);
  };

  std::vector<std::string> adapted;
  std::set<std::string> suffixes;
  std::set<std::string> used_targets;
  for (const auto& [name, layer] : layers) {
    bool hit = false;
    if (all_linear) {
      // Every linear layer inside the decoder layers; never the output head.
      hit = in_decoder_layers(name) && last_component(name) != "lm_head";
    } else if (pattern) {
      hit = std::regex_match(name, *pattern);
    } else {
      for (const auto& t : config.target_modules) {
        if (matches(name, t)) {
          hit = true;
          used_targets.insert(t);
        }
      }
    }
    if (!hit) continue;
    if (last_component(name) == "lm_head") fail("LoRA: target module lm_head is not supported (the output head)");
    adapted.push_back(name);
    suffixes.insert(last_component(name));
  }
  if (!all_linear && !pattern) {
    // A target that names no linear layer is a typo or an unsupported module (embeddings,
    // norms): refuse it rather than train something else than asked.
    std::set<std::string> all_names;
    for (const auto& item : model.named_modules("", false)) all_names.insert(item.key());
    for (const auto& t : config.target_modules) {
      if (used_targets.count(t)) continue;
      for (const auto& n : all_names) {
        if (matches(n, t)) fail("LoRA: target module '{}' ({}) is not a linear layer; only linear layers take adapters", t, n);
      }
      fail("LoRA: target module '{}' not found in the model (linear layers are named like {})", t,
           layers.empty() ? std::string("<none>") : layers.front().first);
    }
  }
  if (adapted.empty()) fail("LoRA: target_modules {} matched no linear layer", fmt::join(config.target_modules, ", "));

  // get_peft_model with bias "none": every base parameter is frozen.
  for (auto& p : model.parameters()) p.set_requires_grad(false);
  const double scaling = config.scaling();
  std::set<std::string> chosen(adapted.begin(), adapted.end());
  for (const auto& [name, layer] : layers) {
    if (chosen.count(name)) layer->add_lora(config.r, scaling, config.lora_dropout);
  }
  if (all_linear) config.target_modules.assign(suffixes.begin(), suffixes.end());
  return adapted;
}

std::string peft_adapter_key(const std::string& parameter_name) {
  const bool adapter = ends_with(parameter_name, ".lora_A.weight") || ends_with(parameter_name, ".lora_B.weight");
  return adapter ? kPeftPrefix + parameter_name : std::string();
}

io::NamedTensors lora_state_dict(const torch::nn::Module& model) {
  io::NamedTensors out;
  for (const auto& [name, layer] : lora_linears(model)) {
    if (!layer->has_lora()) continue;
    out.emplace_back(peft_adapter_key(name + ".lora_A.weight"), layer->lora_A->weight);
    out.emplace_back(peft_adapter_key(name + ".lora_B.weight"), layer->lora_B->weight);
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> lora_named_parameters(const torch::nn::Module& model) {
  return lora_state_dict(model);
}

void load_lora_state_dict(torch::nn::Module& model, const io::NamedTensors& tensors, const std::string& source) {
  std::map<std::string, torch::Tensor> given;
  for (const auto& [raw_name, tensor] : tensors) {
    std::string name = raw_name;
    // Tolerate the in-memory spelling with the adapter name (".lora_A.default.weight").
    for (const char* part : {".lora_A.default.weight", ".lora_B.default.weight"}) {
      if (ends_with(name, part)) {
        name = name.substr(0, name.size() - std::strlen(part)) + std::string(part).substr(0, 7) + ".weight";
      }
    }
    given[name] = tensor;
  }
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  for (const auto& [name, target] : lora_state_dict(model)) {
    auto it = given.find(name);
    if (it == given.end()) fail("{}: adapter tensor {} is missing", source, name);
    if (it->second.sizes() != target.sizes()) {
      fail("{}: adapter tensor {} has shape {}, the model expects {} (different r or base model?)", source, name,
           c10::str(it->second.sizes()), c10::str(target.sizes()));
    }
    if (!it->second.is_floating_point()) fail("{}: adapter tensor {} is not floating point", source, name);
    const_cast<torch::Tensor&>(target).copy_(it->second);
    used.insert(name);
  }
  for (const auto& [name, tensor] : given) {
    if (!used.count(name)) fail("{}: tensor {} matches no adapter of the model", source, name);
  }
}

namespace {
thread_local int adapters_disabled_depth = 0;
}  // namespace

AdaptersDisabled::AdaptersDisabled() { ++adapters_disabled_depth; }
AdaptersDisabled::~AdaptersDisabled() { --adapters_disabled_depth; }
bool AdaptersDisabled::active() { return adapters_disabled_depth > 0; }

void save_adapter(const torch::nn::Module& model, const LoraConfig& config, const std::string& dir,
                  const io::NamedTensors& extra) {
  auto tensors = lora_state_dict(model);
  for (const auto& item : extra) tensors.push_back(item);
  if (tensors.empty()) fail("save_adapter: the model has no LoRA adapters");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("{}: cannot create directory: {}", dir, ec.message());

  // adapter_config.json as PEFT (LoraConfig.save_pretrained) writes it.
  json j;
  j["alpha_pattern"] = json::object();
  j["auto_mapping"] = nullptr;
  j["base_model_name_or_path"] = config.base_model_name_or_path.empty() ? json(nullptr)
                                                                          : json(config.base_model_name_or_path);
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layer_replication"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["loftq_config"] = json::object();
  if (std::floor(config.lora_alpha) == config.lora_alpha) {
    j["lora_alpha"] = static_cast<int64_t>(config.lora_alpha);
  } else {
    j["lora_alpha"] = config.lora_alpha;
  }
  j["lora_dropout"] = config.lora_dropout;
  j["megatron_config"] = nullptr;
  j["megatron_core"] = "megatron.core";
  j["modules_to_save"] = config.modules_to_save.empty() ? json(nullptr) : json(config.modules_to_save);
  j["peft_type"] = "LORA";
  j["r"] = config.r;
  j["rank_pattern"] = json::object();
  j["revision"] = nullptr;
  if (config.target_modules_is_regex) {
    j["target_modules"] = config.target_modules.at(0);
  } else {
    j["target_modules"] = config.target_modules;
  }
  j["task_type"] = config.task_type;
  j["use_dora"] = false;
  j["use_rslora"] = config.use_rslora;

  // Adapter weights first, config last: a directory with a config has its weights.
  io::NamedTensors owned;
  for (const auto& [name, t] : tensors) owned.emplace_back(name, t.detach().cpu().contiguous());
  io::save_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), owned, {{"format", "pt"}});
  write_file_atomically((fs::path(dir) / "adapter_config.json").string(), j.dump(2) + "\n");
}

// The largest adapter rank read from adapter_config.json: published adapters use up to 256
// (PEFT's docs go to 1024); 65536 is no adapter anyone trains, and bounds what r allocates.
constexpr int64_t kMaxLoraRank = int64_t{1} << 16;

LoraConfig read_adapter_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "adapter_config.json").string();
  if (!fs::exists(path)) fail("{}: missing (an adapter directory needs adapter_config.json)", path);
  // Regular files only (a FIFO is refused, not waited on), bounded size and nesting.
  const json j = parse_json(read_file(path, config_json::kMaxConfigJsonBytes), path);
  if (!j.is_object()) fail("{}: not a JSON object", path);
  auto get = [&](const char* key) -> const json* {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  auto non_empty = [&](const char* key) {
    const json* v = get(key);
    return v && !(v->is_object() && v->empty()) && !(v->is_array() && v->empty()) && !(v->is_boolean() && !v->get<bool>());
  };

  const json* type = get("peft_type");
  if (!type || !type->is_string() || type->get<std::string>() != "LORA") {
    fail("{}: peft_type {} is not supported (only LORA)", path, type ? json_excerpt(*type) : "missing");
  }
  // CAUSAL_LM, or SEQ_CLS with the score head saved whole (a reward model's adapter).
  std::string task_type = "CAUSAL_LM";
  if (const json* task = get("task_type")) {
    if (!task->is_string() || (task->get<std::string>() != "CAUSAL_LM" && task->get<std::string>() != "SEQ_CLS")) {
      fail("{}: task_type {} is not supported (CAUSAL_LM, or SEQ_CLS: a reward model's)", path, json_excerpt(*task));
    }
    task_type = task->get<std::string>();
  }
  std::vector<std::string> modules_to_save;
  if (task_type == "SEQ_CLS") {
    modules_to_save = {"score"};
    // PEFT's SEQ_CLS adds its classifier names ("classifier", "score") itself; the head is score.
    if (const json* m = get("modules_to_save"); m && !m->empty()) {
      bool ok = m->is_array();
      for (const auto& item : ok ? *m : json::array()) ok = ok && (item == "score" || item == "classifier");
      if (!ok) {
        fail("{}: modules_to_save = {} is not supported (a reward model's adapter saves its head, score)", path,
             json_excerpt(*m));
      }
    }
  }
  for (const char* key : {"use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform",
                          "layer_replication", "exclude_modules", "target_parameters", "lora_bias",
                          "trainable_token_indices", "alora_invocation_tokens", "arrow_config", "use_qalora"}) {
    if (task_type == "SEQ_CLS" && std::string(key) == "modules_to_save") continue;  // checked above
    if (non_empty(key)) fail("{}: {} = {} is not supported", path, key, json_excerpt(*get(key)));
  }
  if (const json* b = get("bias"); b && (!b->is_string() || b->get<std::string>() != "none")) {
    fail("{}: bias {} is not supported (only \"none\")", path, json_excerpt(*b));
  }

  LoraConfig c;
  c.task_type = task_type;
  c.modules_to_save = modules_to_save;
  const json* r = get("r");
  if (!r) fail("{}: r must be a positive integer, got missing", path);
  // The rank sizes every adapter matrix: bounded before anything is allocated (load_adapter
  // then holds it against the file's lora_A shapes).
  c.r = config_json::as_int(*r, "r", path, 1, kMaxLoraRank);
  const json* alpha = get("lora_alpha");
  if (!alpha) fail("{}: lora_alpha must be a number, got missing", path);
  c.lora_alpha = config_json::as_number(*alpha, "lora_alpha", path);
  if (const json* d = get("lora_dropout")) {
    c.lora_dropout = config_json::as_number(*d, "lora_dropout", path);
  } else {
    c.lora_dropout = 0.0;
  }
  if (const json* rs = get("use_rslora")) {
    if (!rs->is_boolean()) fail("{}: use_rslora must be true or false", path);
    c.use_rslora = rs->get<bool>();
  }
  const json* targets = get("target_modules");
  if (!targets) {
    c.target_modules = {"q_proj", "v_proj"};  // PEFT's default for llama/mistral/qwen2/qwen3
  } else if (targets->is_string()) {
    c.target_modules = {targets->get<std::string>()};
    c.target_modules_is_regex = targets->get<std::string>() != "all-linear";
  } else if (targets->is_array()) {
    c.target_modules.clear();
    for (const auto& t : *targets) {
      if (!t.is_string()) fail("{}: target_modules must list strings, got {}", path, json_excerpt(t));
      c.target_modules.push_back(t.get<std::string>());
    }
  } else {
    fail("{}: target_modules must be a list or a string, got {}", path, json_excerpt(*targets));
  }
  if (const json* base = get("base_model_name_or_path"); base && base->is_string()) {
    c.base_model_name_or_path = base->get<std::string>();
  }
  return c;
}

LoraConfig load_adapter(torch::nn::Module& model, const std::string& dir, io::NamedTensors* saved_modules) {
  LoraConfig config = read_adapter_config(dir);
  if (!config.modules_to_save.empty() && !saved_modules) {
    fail("{}: task_type {} (a reward model's LoRA with its score head) loads only into a reward model (trainer "
         "reward)",
         (fs::path(dir) / "adapter_config.json").string(), config.task_type);
  }
  const fs::path weights = fs::path(dir) / "adapter_model.safetensors";
  if (!fs::exists(weights)) {
    if (fs::exists(fs::path(dir) / "adapter_model.bin")) {
      fail("{}: adapter_model.bin (pickle) is not supported; save the adapter as safetensors", dir);
    }
    fail("{}: adapter_model.safetensors is missing", weights.string());
  }
  auto file = io::load_safetensors(weights.string());  // refuses non-finite values
  // r sizes every adapter matrix apply_lora allocates: held against the file's lora_A shapes
  // ([r, in_features]) first, so a lying adapter_config.json allocates nothing.
  bool any_lora_a = false;
  for (const auto& [name, tensor] : file.tensors) {
    if (name.find(".lora_A.") == std::string::npos) continue;
    any_lora_a = true;
    if (tensor.dim() != 2 || tensor.size(0) != config.r) {
      fail("{}: r is {}, but tensor {} in {} has shape {}", (fs::path(dir) / "adapter_config.json").string(),
           config.r, name, weights.string(), c10::str(tensor.sizes()));
    }
  }
  if (!any_lora_a) fail("{}: holds no lora_A tensor: not a LoRA adapter", weights.string());
  // The modules saved whole (PEFT's base_model.model.<module>.<tensor>) go to the caller.
  io::NamedTensors adapters;
  for (auto& [name, tensor] : file.tensors) {
    bool whole = false;
    for (const auto& m : config.modules_to_save) {
      const std::string prefix = "base_model.model." + m + ".";
      if (name.rfind(prefix, 0) == 0) {
        saved_modules->emplace_back(m + "." + name.substr(prefix.size()), tensor);
        whole = true;
      }
    }
    if (!whole) adapters.emplace_back(name, tensor);
  }
  apply_lora(model, config);
  load_lora_state_dict(model, adapters, weights.string());
  return config;
}

int merge_lora(torch::nn::Module& model) {
  for (const auto& [name, layer] : lora_linears(model)) {
    if (layer->has_lora() && layer->base_quantized()) {
      fail("LoRA: cannot merge into {}: its base weight is quantized; merge the adapter into the unquantized "
           "base (replica merge-adapter --model BASE --adapter DIR, or merge_adapter: true)",
           name);
    }
  }
  int merged = 0;
  for (const auto& [name, layer] : lora_linears(model)) {
    if (!layer->has_lora()) continue;
    layer->merge_lora();
    ++merged;
  }
  return merged;
}

bool has_lora(const torch::nn::Module& model) {
  for (const auto& [name, layer] : lora_linears(model)) {
    if (layer->has_lora()) return true;
  }
  return false;
}

std::vector<std::pair<std::string, std::shared_ptr<LoraLinearImpl>>> quantizable_linears(const torch::nn::Module& model) {
  // QLoRA (bitsandbytes through transformers) replaces the decoder's nn.Linear layers and keeps
  // lm_head in full precision (llm_int8_skip_modules); embeddings and norms are not linears.
  std::vector<std::pair<std::string, std::shared_ptr<LoraLinearImpl>>> out;
  for (auto& [name, layer] : lora_linears(model)) {
    if (in_decoder_layers(name) && last_component(name) != "lm_head") out.emplace_back(name, layer);
  }
  return out;
}

std::vector<std::string> quantize_base_linears(torch::nn::Module& model, const QuantOptions& options) {
  if (!options.enabled()) return {};
  std::vector<std::string> names;
  for (auto& [name, layer] : quantizable_linears(model)) {
    if (layer->base_quantized()) continue;
    layer->quantize_base(options);
    names.push_back(name);
  }
  return names;
}

namespace {
// Every module of `model` that holds a quantized weight.
std::vector<const QuantizedWeightHolder*> quantized_holders(const torch::nn::Module& model) {
  std::vector<const QuantizedWeightHolder*> out;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    const auto* holder = dynamic_cast<const QuantizedWeightHolder*>(module.get());
    if (holder && holder->base_quantized()) out.push_back(holder);
  }
  return out;
}
}  // namespace

bool has_quantized_base(const torch::nn::Module& model) { return !quantized_holders(model).empty(); }

BaseMemory base_memory(const torch::nn::Module& model) {
  BaseMemory m;
  for (const auto& item : model.named_parameters()) {
    if (!peft_adapter_key(item.key()).empty()) continue;
    const auto& p = item.value();
    m.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    m.fp16_bytes += 2 * p.numel();
  }
  for (const auto& item : model.named_buffers()) {
    m.bytes += item.value().numel() * static_cast<int64_t>(item.value().element_size());
  }
  for (const auto* holder : quantized_holders(model)) {
    const auto& q = holder->quantized_weight();
    m.bytes += q.bytes();
    m.fp16_bytes += 2 * q.numel();
    m.quantized_bytes += q.bytes();
    m.quantized_fp16_bytes += 2 * q.numel();
    ++m.quantized_layers;
  }
  return m;
}

}  // namespace replica::models
