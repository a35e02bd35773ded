// LLM supervised fine-tuning: records -> samples -> packed rows -> the Llama model, with or
// without LoRA (see llm_sft.h).
#include "replica/tasks/llm_sft/llm_sft.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/data/records.h"
#include "replica/io/files.h"
#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"
#include "replica/text/chat_template.h"
#include "replica/train/project_dir.h"
#include "replica/train/task.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <utility>

namespace fs = std::filesystem;

namespace replica::train {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

using data::columns_of;


// PEFT's names, and the short forms q, k, v, o, gate, up, down.
std::vector<std::string> peft_target_names(const std::vector<std::string>& names) {
  static const std::map<std::string, std::string> kShort = {{"q", "q_proj"},       {"k", "k_proj"},
                                                            {"v", "v_proj"},       {"o", "o_proj"},
                                                            {"gate", "gate_proj"}, {"up", "up_proj"},
                                                            {"down", "down_proj"}};
  std::vector<std::string> out;
  for (const auto& name : names) {
    auto it = kShort.find(name);
    out.push_back(it == kShort.end() ? name : it->second);
  }
  return out;
}

// Files of a model directory that a tokenizer consists of (carried into final/).
bool is_tokenizer_file(const std::string& name) {
  return name.rfind("tokenizer", 0) == 0 || name == "special_tokens_map.json" || name == "added_tokens.json" ||
         name == "vocab.json" || name == "merges.txt" || name == "chat_template.jinja" ||
         name == "chat_template.json";
}

}  // namespace

void merge_into_project(const RunConfig& config, const std::string& final_dir, const std::string& tag) {
  const fs::path project = fs::path(final_dir).parent_path(), merged = project / "merged";
  models::merge_adapter_dir(config.base_model, final_dir, merged.string());
  std::vector<std::string> kept;
  for (const auto& entry : fs::directory_iterator(merged)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    if (!place_in_project(project, entry.path(), name)) kept.push_back(name);
  }
  spdlog::info("{}: merged model in {} and in {} (where AutoTrain writes it)", tag, merged.string(), project.string());
  if (!kept.empty()) {
    spdlog::warn("{}: {} in {} not replica's, left alone: load the merged model from {}", tag, fmt::join(kept, ", "),
                 project.string(), merged.string());
  }
}

ModelCardInfo llm_model_card(const RunConfig& config) {
  const LlmParams& l = llm_params(config);
  ModelCardInfo card;
  const bool reward = l.trainer == "reward";
  card.library_name = l.peft ? "peft" : "transformers";
  card.tags = {reward ? "text-classification" : "text-generation", l.trainer};
  if (l.peft) card.tags.push_back("lora");
  const std::string cls = reward ? "AutoModelForSequenceClassification" : "AutoModelForCausalLM";
  if (l.peft && !(l.merge_adapter && !reward)) {
    card.usage = fmt::format(R"(```python
from peft import PeftModel
from transformers import {0}, AutoTokenizer

base = {0}.from_pretrained("{1}"{2})
model = PeftModel.from_pretrained(base, "{3}/final")
tokenizer = AutoTokenizer.from_pretrained("{3}/final")
```
)",
                             cls, config.base_model, reward ? ", num_labels=1" : "", config.project_name);
  } else {
    const std::string dir = l.peft ? config.project_name : config.project_name + "/final";
    card.usage = fmt::format(R"(```python
from transformers import {0}, AutoTokenizer

model = {0}.from_pretrained("{1}")
tokenizer = AutoTokenizer.from_pretrained("{1}")
```
)",
                             cls, dir);
  }
  return card;
}

void copy_tokenizer_files(const std::string& from, const std::string& to) {
  for (const auto& entry : fs::directory_iterator(from)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || !is_tokenizer_file(name)) continue;
    copy_file_atomically(entry.path().string(), (fs::path(to) / name).string());
  }
}

// ---------------------------------------------------------------------------------------
// Settings and checks

LlmSftSettings llm_sft_settings(const RunConfig& config) {
  const LlmParams& p = llm_params(config);
  LlmSftSettings s;
  s.peft = p.peft;
  s.lora.r = p.lora_r;
  s.lora.lora_alpha = static_cast<double>(p.lora_alpha);
  s.lora.lora_dropout = p.lora_dropout;
  s.lora.target_modules = p.target_modules == std::vector<std::string>{"all-linear"}
                              ? p.target_modules
                              : peft_target_names(p.target_modules);
  s.lora.base_model_name_or_path = config.base_model;
  s.model_max_length = p.model_max_length;
  s.block_size = p.block_size == -1 ? p.model_max_length : p.block_size;
  s.packing = p.packing;
  s.pad_left = p.padding == "left";
  s.merge_adapter = p.merge_adapter;
  s.add_eos_token = p.add_eos_token;
  return s;
}

// params.quantization and params.quantize_embeddings as the loader takes them.
models::QuantOptions quant_options_of(const RunConfig& config) {
  auto options = models::quant_options(llm_params(config).quantization, "params.quantization");
  options.embeddings = llm_params(config).quantize_embeddings;
  return options;
}

torch::ScalarType torch_dtype_of(const RunConfig& config);  // Note [bf16 weights]

void check_llm_sft_config(const RunConfig& config) {
  const LlmSftSettings s = llm_sft_settings(config);
  if (llm_params(config).peft && llm_params(config).quantize_embeddings && !quant_options_of(config).enabled()) {
    fail("quantize_embeddings: true needs quantization int4 or int8 (it holds the embeddings and lm_head in that "
         "format); quantization is {}",
         llm_params(config).quantization);
  }
  // Quantization is for a frozen base under adapters (QLoRA); without peft it is ignored, as AutoTrain
  // ignores it (its own defaults are int4 with peft false), with a note (llm_sft_task).
  if (llm_params(config).peft && quant_options_of(config).enabled()) {
    // QLoRA: the quantized base is frozen, only adapters over it train (models/quant.h).
    if (zero_stage_of(config.params) == 3) {
      // ZeRO-3 shards and gathers parameters; the quantized weights are codes beside the
      // parameters, which it would neither shard nor gather (DeepSpeed needs special handling
      // for bitsandbytes' weights too). Stages 0-2 shard only gradients and optimizer state:
      // the adapters', which they handle as any parameters.
      fail("quantization {} with distributed_backend zero3 (ZeRO stage 3) is not supported: ZeRO-3 shards "
           "parameters and a quantized base is held as codes that are not parameters; use distributed_backend "
           "ddp (zero_stage 0-2; each worker holds the whole base, about a quarter of its fp16 bytes with int4) "
           "or quantization none",
           llm_params(config).quantization);
    }
  }
  if (!llm_params(config).init_adapter.empty()) {
    if (!llm_params(config).peft) fail("params.init_adapter '{}' needs peft: true (it holds LoRA adapters)", llm_params(config).init_adapter);
    if (!fs::is_directory(llm_params(config).init_adapter)) {
      fail("params.init_adapter '{}' is not an adapter directory", llm_params(config).init_adapter);
    }
    const auto adapter = models::read_adapter_config(llm_params(config).init_adapter);
    const bool reward = llm_params(config).trainer == "reward";
    if ((adapter.task_type == "SEQ_CLS") != reward) {
      fail("params.init_adapter '{}' is a {} adapter; trainer {} needs a {} one", llm_params(config).init_adapter,
           adapter.task_type, llm_params(config).trainer, reward ? "SEQ_CLS (reward model)" : "CAUSAL_LM");
    }
  }
  if (llm_params(config).torch_dtype == "float16") {
    fail("params.torch_dtype float16 is not supported: float16 weights need loss scaling through every layer; use "
         "torch_dtype: bfloat16 (bf16 weights, fp32 masters) or mixed_precision: fp16 (fp32 weights, fp16 compute "
         "under a loss scaler)");
  }
  if (llm_params(config).unsloth) fail("unsloth is not available in replica (a CUDA-only library); leave unsloth false");
  const fs::path model(config.base_model);
  if (!fs::is_directory(model)) fail("base_model '{}' is not a model directory", config.base_model);
  if (!fs::exists(model / "config.json")) fail("base_model '{}' has no config.json", config.base_model);
  if (!fs::exists(model / "tokenizer.json") && !fs::exists(model / "tokenizer.model")) {
    fail("base_model '{}' has no tokenizer (tokenizer.json or tokenizer.model)", config.base_model);
  }
  models::read_hf_config(config.base_model);  // an unsupported architecture is an error here
  if (torch_dtype_of(config) == torch::kBFloat16 && config.params.mixed_precision == Precision::Fp16) {
    fail("params.torch_dtype {} (bf16 weights) with mixed_precision fp16: autocast would compute the bf16 weights "
         "in fp16; use mixed_precision bf16 or none with bf16 weights",
         llm_params(config).torch_dtype);
  }
  const std::string file = data::resolve_records_file(config.data.path, config.data.train_split);
  if (!fs::exists(file)) fail("data: training file '{}' does not exist", file);
  if (config.data.valid_split) {
    const std::string valid = data::resolve_records_file(config.data.path, *config.data.valid_split);
    if (!fs::exists(valid)) fail("data: validation file '{}' does not exist", valid);
  }
  if (s.model_max_length < 2) fail("params.model_max_length must be at least 2, got {}", s.model_max_length);
  if (s.block_size < 2) fail("params.block_size must be at least 2 (or -1), got {}", s.block_size);
}

// Note [bf16 weights]
// torch_dtype: bfloat16 holds every weight of the model in bf16, as transformers'
// from_pretrained(torch_dtype=torch.bfloat16) does, and the step computes in bf16 throughout
// (no autocast casts; mixed_precision: bf16 on top changes nothing). What transformers' Trainer
// then does, stepping the bf16 weights themselves, loses updates smaller than half a bf16 ulp
// of the weight (lr 1e-5 on a weight of 1 is 1/400 of one). replica does not: full
// fine-tuning's optimizer steps fp32 master copies and rounds them into the weights (Note
// [master weights] in train/optim.cpp; the masters go into every checkpoint, so a resumed run
// continues bit for bit), ZeRO-3 keeps its own fp32 master shards (zero/zero3.h), and LoRA
// over the bf16 base trains fp32 adapters (PEFT's autocast_adapter_dtype). Half the weight
// memory and bf16 GEMMs with no casts per step: what FSDP2's MixedPrecisionPolicy and
// DeepSpeed's bf16 mode run. Without it (float32), the weights are fp32 and mixed_precision
// bf16 computes under autocast; peft with mixed_precision bf16 holds the frozen base in bf16.
torch::ScalarType torch_dtype_of(const RunConfig& config) {
  const std::string& name = llm_params(config).torch_dtype;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "auto") {
    // config.json's, where it is bfloat16; a float16 checkpoint trains in float32 (its weights
    // widen exactly) since float16 weights would need loss scaling through every layer.
    return models::read_hf_config(config.base_model).torch_dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat32;
  }
  return torch::kFloat32;
}

torch::ScalarType base_weight_dtype(const RunConfig& config) {
  if (torch_dtype_of(config) == torch::kBFloat16) return torch::kBFloat16;
  // PEFT in bf16: the frozen base is held in bf16 (the adapters stay fp32, the master
  // weights); full fine-tuning keeps fp32 weights and computes in bf16 under autocast.
  const bool bf16 = config.params.mixed_precision == Precision::Bf16;
  return llm_sft_settings(config).peft && bf16 ? torch::kBFloat16 : torch::kFloat32;
}

models::LlamaForCausalLM load_llm_for_training(const RunConfig& config, const WorkloadContext& context,
                                               const std::string& tag, models::LoraConfig* lora,
                                               models::HfExtraTensors* extra) {
  const LlmSftSettings settings = llm_sft_settings(config);
  models::LlamaForCausalLM model{nullptr};
  const bool main = context.is_main();
  const auto dtype = base_weight_dtype(config);
  // quantization: every decoder linear quantized as it is read (QLoRA's load_in_4bit/8bit).
  const auto quant = llm_params(config).peft ? quant_options_of(config) : models::QuantOptions{};
  model = models::load_hf_model(config.base_model, dtype, quant, extra);
  if (main) spdlog::info("{}: model {}", tag, models::describe_model(model->config()));
  if (quant.enabled() && main) {
    constexpr double kMiB = 1024.0 * 1024.0;
    const auto m = models::base_memory(*model);
    spdlog::info("{}: base quantized to {}: {} weights ({}) in {:.2f} MiB ({:.3f}x fp16), the whole "
                 "base {:.2f} MiB ({:.3f}x fp16; {} in {})",
                 tag, models::describe(quant), m.quantized_layers,
                 quant.embeddings ? "decoder linears, embeddings, head" : "decoder linears", m.quantized_bytes / kMiB,
                 static_cast<double>(m.quantized_bytes) / static_cast<double>(m.quantized_fp16_bytes),
                 m.bytes / kMiB, static_cast<double>(m.bytes) / static_cast<double>(m.fp16_bytes),
                 quant.embeddings ? "norms" : "embeddings, head and norms", models::dtype_to_string(dtype));
  }
  if (llm_params(config).router_aux_loss_coef >= 0) {
    try {
      model->set_router_aux_loss(llm_params(config).router_aux_loss_coef);
    } catch (const Error& e) {
      fail("params.router_aux_loss_coef: {} ({})", e.what(), config.base_model);
    }
  }
  if (main && model->config().output_router_logits) {
    spdlog::info("{}: the router's load-balancing loss x {} added to the training loss", tag,
                 model->config().router_aux_loss_coef);
  }
  // AutoTrain's default: every decoder layer recomputed in backward (models/recompute.h).
  model->model->set_gradient_checkpointing(!llm_params(config).disable_gradient_checkpointing);
  if (settings.peft) {
    std::vector<std::string> adapted;
    if (!llm_params(config).init_adapter.empty()) {
      // Continue an adapter: its own LoraConfig, its weights (a reward model's score head to
      // `extra`, which the reward workload reads as it reads a checkpoint's head).
      io::NamedTensors whole;
      *lora = models::load_adapter(*model, llm_params(config).init_adapter, extra ? &whole : nullptr);
      lora->base_model_name_or_path = config.base_model;
      for (auto& [name, tensor] : whole) extra->taken[name] = tensor;
      for (const auto& item : model->named_modules()) {
        if (auto* l = dynamic_cast<models::LoraLinearImpl*>(item.value().get()); l && l->has_lora()) {
          adapted.push_back(item.key());
        }
      }
      if (main) spdlog::info("{}: LoRA adapters start from {}", tag, llm_params(config).init_adapter);
    } else {
      *lora = settings.lora;
      adapted = models::apply_lora(*model, *lora);
    }
    if (main) {
      // A quantized weight is not a parameter any more; it still counts in the model's size.
      int64_t trainable = 0, total = models::base_memory(*model).quantized_fp16_bytes / 2;
      for (const auto& p : model->parameters()) {
        total += p.numel();
        if (p.requires_grad()) trainable += p.numel();
      }
      spdlog::info("{}: LoRA r {} alpha {} dropout {} on {} modules ({}); {} trainable of {} parameters", tag,
                   lora->r, lora->lora_alpha, lora->lora_dropout, adapted.size(),
                   fmt::join(lora->target_modules, ","), trainable, total);
    }
  } else if (main) {
    spdlog::info("{}: full fine-tuning of {} parameters", tag, [&] {
      int64_t n = 0;
      for (const auto& p : model->parameters()) n += p.numel();
      return n;
    }());
  }
  return model;
}

namespace {

SftEncoderOptions encoder_options(const RunConfig& config, int64_t max_length) {
  SftEncoderOptions o;
  o.chat_template = config.data.chat_template;
  o.column_mapping = config.data.column_mapping;
  o.add_eos_token = llm_sft_settings(config).add_eos_token;
  o.max_length = max_length;
  o.response_only_loss = llm_params(config).response_only_loss;
  return o;
}

class LlmSft final : public Workload {
 public:
  LlmSft(const RunConfig& config, const WorkloadContext& context)
      : config_(config), context_(context), settings_(llm_sft_settings(config)) {
    check_llm_sft_config(config);
    const bool main = context.is_main();
    model_ = load_llm_for_training(config, context, "llm-sft", &lora_);
    // Training samples: truncated to the longest a row can hold, packed into rows (or one per
    // row without packing).
    const int64_t max_len = std::min(settings_.model_max_length, settings_.block_size);
    SftEncoder encoder(config.base_model, encoder_options(config, max_len));
    const auto& tok = encoder.tokenizer();
    if (tok.vocab_size() > model_->config().vocab_size) {
      fail("the tokenizer of '{}' has {} ids but the model's vocab_size is {}", config.base_model,
           tok.vocab_size(), model_->config().vocab_size);
    }
    pad_id_ = tok.pad_id().value_or(tok.eos_id().value_or(0));
    int64_t dropped = 0;
    train_ = SftRows::build(encode_split(encoder, config.data.path, config.data.train_split, &dropped),
                            settings_.packing, settings_.block_size);
    if (main) {
      const std::string skipped = dropped ? fmt::format("; {} samples without a trained token dropped", dropped) : "";
      if (settings_.packing) {
        spdlog::info("llm-sft: {} samples ({} tokens, {} trained) packed into {} rows of <= {} tokens ({:.1f}% full){}",
                     train_.samples.size(), train_.tokens, train_.trained, train_.rows.size(), settings_.block_size,
                     100.0 * static_cast<double>(train_.tokens) /
                         (static_cast<double>(train_.rows.size()) * settings_.block_size),
                     skipped);
      } else {
        spdlog::info("llm-sft: {} samples ({} tokens, {} trained), one per row (no packing), each of <= {} tokens, "
                     "padded on the {} to the longest of its micro-batch{}",
                     train_.samples.size(), train_.tokens, train_.trained, max_len, settings_.pad_left ? "left" : "right",
                     skipped);
      }
      if (settings_.block_size > model_->config().max_position_embeddings) {
        spdlog::warn("llm-sft: block_size {} is longer than the model's max_position_embeddings {}",
                     settings_.block_size, model_->config().max_position_embeddings);
      }
    }
    if (config.data.valid_split) {
      SftEncoder valid_encoder(config.base_model, encoder_options(config, settings_.model_max_length));
      valid_ = encode_split(valid_encoder, config.data.path, *config.data.valid_split, nullptr);
    }
  }

  std::shared_ptr<torch::nn::Module> model() override { return model_.ptr(); }
  ModelCardInfo model_card() const override { return llm_model_card(config_); }
  int64_t train_size() const override { return static_cast<int64_t>(train_.rows.size()); }
  int64_t valid_size() const override { return static_cast<int64_t>(valid_.size()); }

  int64_t loss_items(const std::vector<int64_t>& indices) const override { return train_.items_in(indices); }
  int64_t tokens_in(const std::vector<int64_t>& indices) const override { return train_.tokens_in(indices); }

  torch::Tensor train_loss_sum(const std::vector<int64_t>& indices) override {
    const DeviceBatch d = batch_of(indices);
    const PackedBatch& b = d.batch;
    // The head and its loss a chunk of tokens at a time: no [tokens, vocab] logits (llama.h).
    models::TokenLoss parts = model_->loss_sum(b.input_ids, b.labels, b.segment_ids, /*chunk_tokens=*/0, d.facts);
    last_aux_ = parts.aux;
    return parts.sum;
  }
  torch::Tensor train_aux_loss() override { return std::exchange(last_aux_, torch::Tensor()); }
  torch::Tensor train_loss(const std::vector<int64_t>& indices) override {
    const DeviceBatch d = batch_of(indices);
    const PackedBatch& b = d.batch;
    const models::TokenLoss parts = model_->loss_sum(b.input_ids, b.labels, b.segment_ids, /*chunk_tokens=*/0, d.facts);
    auto loss = parts.sum / parts.count.clamp_min(1).to(torch::kFloat32);
    return parts.aux.defined() ? loss + parts.aux.to(torch::kFloat32) : loss;
  }

  EvalSums evaluate(const std::vector<int64_t>& indices) override {
    torch::NoGradGuard no_grad;
    EvalSums sums;
    for (int64_t i : indices) {
      const SftSample& s = valid_.at(static_cast<size_t>(i));
      const int64_t n = static_cast<int64_t>(s.ids.size());
      auto host_ids = torch::tensor(std::vector<int64_t>(s.ids.begin(), s.ids.end()), torch::kInt64).view({1, n});
      const auto facts = models::host_batch_facts(host_ids, {}, model_->config().vocab_size, context_.device,
                                                  "llm-sft validation input_ids");
      auto ids = context_.on_device(host_ids);
      auto labels =
          context_.on_device(torch::tensor(std::vector<int64_t>(s.labels.begin(), s.labels.end()), torch::kInt64).view({1, n}));
      auto logits = model_->forward(ids, {}, {}, facts).to(torch::kFloat32);
      auto parts = models::causal_lm_loss_sum(logits, labels);
      sums.loss_sum += parts.sum.item<double>();
      sums.tokens += static_cast<double>(parts.count.item<int64_t>());
      if (n > 1) {
        auto predicted = logits[0].narrow(0, 0, n - 1).argmax(-1);
        auto target = labels[0].narrow(0, 1, n - 1);
        sums.correct += predicted.eq(target).logical_and(target.ne(kIgnoreLabel)).sum().item<double>();
      }
      sums.count += 1;
    }
    return sums;
  }

  nlohmann::json model_config() const override { return json::parse(model_->config().to_json_string()); }

  std::string checkpoint_model_file() const override {
    return settings_.peft ? "adapter_model.safetensors" : "model.safetensors";
  }
  io::NamedTensors state_tensors() override {
    if (!settings_.peft) return Workload::state_tensors();
    io::NamedTensors out;
    for (const auto& [name, t] : models::lora_state_dict(*model_)) out.emplace_back(name, t.detach());
    return out;
  }
  void load_state_tensors(const io::NamedTensors& tensors, const std::string& where) override {
    if (!settings_.peft) return Workload::load_state_tensors(tensors, where);
    models::load_lora_state_dict(*model_, tensors, where);
  }
  void write_checkpoint_extras(const std::string& dir) const override {
    if (settings_.peft) {
      models::save_adapter(*model_, lora_, dir);  // adapter_config.json (and the same weights again)
    } else {
      models::LlamaConfig c = model_->config();
      // The weights as held (fp32, or bf16 with their fp32 masters in optimizer.safetensors).
      c.torch_dtype = models::dtype_to_string(held_weight_dtype(*model_));
      write_file_atomically((fs::path(dir) / "config.json").string(), c.to_json_string());
    }
  }

  void save_final(const std::string& final_dir) override {
    fs::create_directories(final_dir);
    if (settings_.peft) {
      models::save_adapter(*model_, lora_, final_dir);
      copy_tokenizer_files(config_.base_model, final_dir);
      if (settings_.merge_adapter) merge_into_project(config_, final_dir, "llm-sft");
    } else {
      // A plain HF model directory in the base checkpoint's dtype, with its tokenizer.
      models::save_hf_model_dir(model_, final_dir, config_.base_model);
    }
  }

 private:
  DeviceBatch batch_of(const std::vector<int64_t>& indices) const {
    return to_device(make_packed_batch(train_.samples, train_.rows, indices, pad_id_, settings_.pad_left),
                     model_->config().vocab_size, context_);
  }

  RunConfig config_;
  WorkloadContext context_;
  LlmSftSettings settings_;
  models::LlamaForCausalLM model_{nullptr};
  models::LoraConfig lora_;
  SftRows train_;
  std::vector<SftSample> valid_;
  int32_t pad_id_ = 0;
  torch::Tensor last_aux_;  // train_aux_loss
};

}  // namespace

DeviceBatch to_device(const PackedBatch& host, int64_t vocab_size, const WorkloadContext& context) {
  // Note [token ids checked on the host] (models/llama.cpp); the layout: Note [packed attention].
  DeviceBatch d;
  d.facts = models::host_batch_facts(host.input_ids, host.segment_ids, vocab_size, context.device,
                                     "llm-sft batch input_ids");
  d.batch = {context.on_device(host.input_ids), context.on_device(host.labels), context.on_device(host.segment_ids)};
  return d;
}

std::unique_ptr<Workload> make_llm_sft(const RunConfig& config, const WorkloadContext& context) {
  return std::make_unique<LlmSft>(config, context);
}

namespace {

// unused_when for a key that only `trainers` read: "for trainer dpo (only sft reads it: why)".
std::function<std::string(const RunConfig&)> only_for(std::vector<std::string> trainers, std::string why) {
  return [trainers = std::move(trainers), why = std::move(why)](const RunConfig& c) -> std::string {
    const std::string& t = llm_params(c).trainer;
    if (std::find(trainers.begin(), trainers.end(), t) != trainers.end()) return "";
    return fmt::format("for trainer {} (only {} read{} it{}; AutoTrain ignores it too)", t, fmt::join(trainers, ", "),
                       trainers.size() == 1 ? "s" : "", why.empty() ? "" : ": " + why);
  };
}

// unused_when for the LoRA keys: nothing without peft.
std::string without_peft(const RunConfig& c) {
  return llm_params(c).peft ? "" : "without peft: true (no adapters; AutoTrain ignores it too)";
}

// Where replica's llm defaults differ from AutoTrain's in what they train, and the config left
// them so (Note [defaults that differ from AutoTrain's] in docs/llm.md's migration section).
std::vector<std::string> llm_default_notes(const RunConfig& c, const KeyLocation& loc) {
  const LlmParams& l = llm_params(c);
  std::vector<std::string> notes;
  auto given = [&](const char* key) { return loc.given(std::string("params.") + key); };
  // data.column_mapping keys the trainer does not read (the task reads them for its others).
  static const std::vector<std::string> kPreferenceColumns = {"prompt_text_column", "rejected_text_column"};
  static const std::vector<std::string> kSftColumns = {"messages_column", "prompt_column", "completion_column"};
  const bool sft = l.trainer == "sft";
  for (const auto& [column, value] : c.data.column_mapping) {
    const auto& others = sft ? kPreferenceColumns : kSftColumns;
    if (std::find(others.begin(), others.end(), column) == others.end()) continue;
    const std::string key = "data.column_mapping." + column;
    notes.push_back(fmt::format("{}{} has no effect for trainer {} (only {} read{} it; AutoTrain ignores it too)",
                                loc.where(key), loc.name(key), l.trainer, sft ? "dpo, orpo and reward" : "sft",
                                sft ? "" : "s"));
  }
  if (!given("block_size") && l.block_size == -1 && l.model_max_length > 1024) {
    notes.push_back(fmt::format(
        "block_size -1: rows of model_max_length = {} tokens; AutoTrain's -1 is min(1024, model_max_length) "
        "(set block_size: {} for AutoTrain's)",
        l.model_max_length, std::min<int64_t>(1024, l.model_max_length)));
  }
  if (l.peft && !given("quantization")) {
    notes.push_back("quantization none: the base is held unquantized; AutoTrain 0.8.36 quantizes it to int4 "
                    "by default under peft (set quantization: int4 for its QLoRA)");
  }
  if (l.peft && !given("merge_adapter")) {
    notes.push_back("merge_adapter false: final/ holds the adapter; AITraining merges by default (set "
                    "merge_adapter: true for a merged model in project_name, as AutoTrain writes it)");
  }
  if (!loc.given("data.chat_template")) {
    notes.push_back("chat_template tokenizer: chats are rendered with the model's template; AutoTrain's "
                    "default (null) renders none (set chat_template: none for that)");
  }
  return notes;
}

}  // namespace

TaskSpec llm_sft_task() {
  TaskSpec t;
  t.name = "llm-sft";
  t.params = TaskParams(LlmParams{});
  t.summary =
      "fine-tuning of a Llama-family model (full or LoRA), AutoTrain's LLMTrainingParams: trainers sft, dpo, orpo, "
      "reward";
  t.columns = {"text_column", "messages_column", "prompt_column", "completion_column", "prompt_text_column",
               "rejected_text_column"};
  t.twins = {
      {"chat_template", "data.chat_template: tokenizer, chatml, llama3 or none", ""},
      {"text_column",
       "data.column_mapping.text_column (dpo, orpo, reward: the chosen completion's column; without it, TRL's chosen)",
       ""},
      {"prompt_text_column", "data.column_mapping.prompt_text_column: dpo, orpo, reward", "prompt"},
      {"rejected_text_column", "data.column_mapping.rejected_text_column: dpo, orpo, reward", "rejected"},
  };
  using L = LlmParams;
  t.keys = {
      key("trainer", &L::trainer,
          "the trainer: sft (supervised fine-tuning), dpo (direct preference optimization), orpo (odds-ratio "
          "preference optimization), reward (a reward model: the decoder with a scalar score head)")
          .group("LLM")
          .one_of({"sft", "dpo", "orpo", "reward"})
          .alias("default", "sft"),  // AutoTrain's name for plain SFT
      key("peft", &L::peft, "train LoRA adapters on the frozen model instead of every weight").group("LoRA"),
      key("lora_r", &L::lora_r, "LoRA rank").group("LoRA").at_least(1).unused_when(without_peft),
      key("lora_alpha", &L::lora_alpha, "LoRA scale numerator (scale = alpha / r)")
          .group("LoRA")
          .at_least(1)
          .unused_when(without_peft),
      key("lora_dropout", &L::lora_dropout, "dropout on the adapters' input")
          .group("LoRA")
          .fraction()
          .unused_when(without_peft),
      key("target_modules", &L::target_modules,
          "the adapted linears: all-linear, or names (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
          .group("LoRA")
          .unused_when(without_peft),
      key("init_adapter", &L::init_adapter,
          "peft: start from this PEFT adapter directory instead of fresh adapters (its r, lora_alpha, dropout and "
          "target modules; a reward model's also its score head): continue training an adapter, e.g. DPO after SFT")
          .group("LoRA")
          .null_is(""),
      key("merge_adapter", &L::merge_adapter,
          "also fold the adapter into the base model: project_name/merged/, and the merged model's files in "
          "project_name itself, where AutoTrain writes them")
          .group("LoRA")
          .unused_when([](const RunConfig& c) {
            if (!llm_params(c).peft) return without_peft(c);
            return llm_params(c).trainer == "reward"
                       ? std::string("for trainer reward (a reward model's adapter and score head stay an adapter: "
                                     "load final/ with PEFT)")
                       : std::string();
          }),
      key("model_max_length", &L::model_max_length, "samples are truncated to this many tokens")
          .group("LLM")
          .at_least(1),
      key("block_size", &L::block_size, "row length: packed rows hold up to this many tokens, and samples are "
          "truncated to it (-1: model_max_length)")
          .group("LLM")
          .list_of_one("AutoTrain reads 64,128 into a list, which none of its trainers can use (its "
                       "configure_block_size compares the list with a number and fails); give one size")
          .off_or_at_least(-1, 1, "model_max_length"),
      key("packing", &L::packing,
          "pack samples first-fit into rows of block_size (AutoTrain's SFT always packs); false: one sample per row")
          .group("LLM")
          .unused_when(only_for({"sft"}, "preference rows are never packed")),
      key("response_only_loss", &L::response_only_loss,
          "sft: loss only on the completion or the assistant turns (AITraining's name; false: on every token)")
          .group("LLM")
          .unused_when(only_for({"sft"}, "preference losses are on completions by definition")),
      key("padding", &L::padding,
          "side a row shorter than its micro-batch's longest is padded on: right or left (pads are never attended "
          "nor trained on; positions start at 0 at a sample's first token either way)")
          .group("LLM")
          .one_of({"right", "left"}),
      key("add_eos_token", &L::add_eos_token, "end every text sample with the tokenizer's EOS")
          .group("LLM")
          .unused_when(only_for({"sft"}, "TRL ends every completion with EOS")),
      key("quantization", &L::quantization,
          "QLoRA: the frozen base's decoder linears held quantized, dequantized per layer on the fly (needs peft; "
          "int4: NF4, blocks of 64, double-quantized absmax, ~0.26x fp16; int8: per-row absmax, ~0.5x)")
          .group("LLM")
          .one_of({"none", "int4", "int8"})
          .null_is("none")
          .unused_when([](const RunConfig& c) {
            return llm_params(c).peft || llm_params(c).quantization == "none"
                       ? std::string()
                       : std::string("without peft: true (AutoTrain quantizes only under peft, and so does replica: "
                                     "full fine-tuning trains every weight in full precision)");
          }),
      key("quantize_embeddings", &L::quantize_embeddings,
          "with quantization: hold the token embeddings and an untied lm_head in the same format too (bitsandbytes "
          "keeps them in 16 bits; they are 2 x vocab x hidden weights, a large share of a small model's base)")
          .group("LLM"),
      key("disable_gradient_checkpointing", &L::disable_gradient_checkpointing,
          "keep every decoder layer's activations instead of recomputing them in backward (activation "
          "checkpointing, on by default as in AutoTrain: less memory, one more forward)")
          .group("LLM"),
      key("use_flash_attention_2", &L::use_flash_attention_2,
          "accepted for AutoTrain configs (attention is always PyTorch's fused SDPA)")
          .group("LLM")
          .unused_when([](const RunConfig& c) {
            return llm_params(c).use_flash_attention_2
                       ? std::string("(attention is always PyTorch's fused SDPA, which takes its flash kernel on a "
                                     "GPU where it can)")
                       : std::string();
          }),
      key("torch_dtype", &L::torch_dtype,
          "the dtype the model's weights are held in: float32, or bfloat16 (half the weight memory, bf16 compute "
          "throughout; the optimizer steps fp32 master weights, LoRA adapters stay fp32); auto: config.json's "
          "(bfloat16, else float32)")
          .group("LLM")
          .one_of({"float32", "bfloat16", "auto", "float16"})
          .alias("bf16", "bfloat16")
          .alias("fp32", "float32")
          .alias("float", "float32")
          .null_is("float32"),
      key("unsloth", &L::unsloth, "Unsloth's kernels (CUDA-only: refused)").group("LLM"),
      key("router_aux_loss_coef", &L::router_aux_loss_coef,
          "mixture-of-experts models (gpt_oss): add this times the router's load-balancing loss to the training "
          "loss, averaged over micro-batches and workers (transformers' output_router_logits; 0: off)")
          .group("LLM")
          .off_or_at_least(-1.0, 0.0, "as the model's config.json says: off in the published checkpoints"),
      key("model_ref", &L::model_ref,
          "dpo: the reference model's directory (default: the frozen base; with peft, the base with the adapters "
          "disabled, no second copy)")
          .group("Preference (dpo, orpo, reward)")
          .null_is("")
          .unused_when(only_for({"dpo"}, "only DPO has a reference model")),
      key("dpo_beta", &L::dpo_beta, "dpo and orpo: beta (DPO: the KL penalty's weight; ORPO: the odds-ratio term's)")
          .group("Preference (dpo, orpo, reward)")
          .positive()
          .unused_when(only_for({"dpo", "orpo"}, "")),
      key("max_prompt_length", &L::max_prompt_length,
          "preference trainers: a prompt keeps its last this many tokens")
          .group("Preference (dpo, orpo, reward)")
          .at_least(1)
          .unused_when(only_for({"dpo", "orpo", "reward"}, "")),
      key("max_completion_length", &L::max_completion_length,
          "preference trainers: a completion keeps its first this many tokens (-1: no limit)")
          .group("Preference (dpo, orpo, reward)")
          .null_is(-1)
          .off_or_at_least(-1, 1, "no limit")
          .unused_when(only_for({"dpo", "orpo", "reward"}, "")),
  };
  t.defaults = [](RunConfig& c) {
    // AutoTrain's LLMTrainingParams defaults.
    c.data.column_mapping = {{"text_column", "text"}};
    RunParams& p = c.params;
    p.lr = 3e-5;
    p.epochs = 1;
    p.batch_size = 2;
    p.gradient_accumulation = 4;
    p.warmup_ratio = 0.1;
    p.optimizer = OptimizerKind::AdamW;
    p.scheduler = SchedulerKind::Linear;
    p.weight_decay = 0.0;
    p.max_grad_norm = 1.0;
    p.seed = 42;
    p.mixed_precision = Precision::Fp32;  // AutoTrain's default is none
    p.save_total_limit = 1;
  };
  // AutoTrain's task names (its parser maps llm-TRAINER to the llm task with that trainer; llm and
  // llm-generic to its default trainer, which replica's sft is).
  t.aliases = {{"llm", {}},
               {"llm-generic", {{"trainer", "sft"}}},
               {"llm-dpo", {{"trainer", "dpo"}}},
               {"llm-orpo", {{"trainer", "orpo"}}},
               {"llm-reward", {{"trainer", "reward"}}}};
  t.default_notes = llm_default_notes;
  t.check = check_llm_sft_config;
  t.make = make_llm_sft;
  return t;
}

LlmEvalResult evaluate_llm(const RunConfig& config, const std::string& adapter_dir) {
  const LlmSftSettings settings = llm_sft_settings(config);
  // With quantization the adapter is evaluated over the quantized base, as it was trained.
  auto model = models::load_hf_model(config.base_model, torch::kFloat32, quant_options_of(config));
  if (!adapter_dir.empty()) models::load_adapter(*model, adapter_dir);
  SftEncoder encoder(config.base_model, encoder_options(config, settings.model_max_length));
  const std::string split = config.data.valid_split.value_or(config.data.train_split);
  const auto samples = encode_split(encoder, config.data.path, split, nullptr);
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<uint8_t>> masks;
  LlmEvalResult r;
  for (const auto& s : samples) {
    ids.push_back(s.ids);
    masks.push_back(s.loss_mask());
    r.tokens += s.predicted();
  }
  r.samples = static_cast<int64_t>(samples.size());
  r.loss = models::mean_token_loss(model, ids, &masks);
  return r;
}

}  // namespace replica::train
