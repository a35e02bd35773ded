#include "replica/models/hf_model_dir.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/io/files.h"
#include "replica/models/config_json.h"
#include "replica/models/mxfp4.h"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <unistd.h>

namespace replica::models {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

bool is_lora_name(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}


// Files save_pretrained / tokenizer.save_pretrained leave next to the weights, other than
// config.json and the weights themselves.
bool is_carried_file(const std::string& name) {
  static const std::set<std::string> kNames = {
      "generation_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
      "merges.txt", "chat_template.jinja", "chat_template.json"};
  return kNames.count(name) || name.rfind("tokenizer", 0) == 0;
}

// DIR/model.safetensors.index.json's weight_map: tensor name -> DIR/shard file. Read as every
// outside JSON is (regular file, bounded size and nesting); replica::Error naming the index.
std::map<std::string, std::string> read_weight_index(const std::string& dir) {
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  const json index = parse_json(read_file(index_path, config_json::kMaxIndexJsonBytes), index_path);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    fail("{}: weight_map is missing or not an object", index_path);
  }
  std::map<std::string, std::string> file_of;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    if (!file.is_string()) {
      fail("{}: weight_map entry {} is not a file name: {}", index_path, json_excerpt(json(tensor)), json_excerpt(file));
    }
    const std::string name = file.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      fail("{}: weight_map entry {} names {}, not a file in the directory", index_path, json_excerpt(json(tensor)),
           json_excerpt(file));
    }
    file_of[tensor] = (fs::path(dir) / name).string();
  }
  if (file_of.empty()) fail("{}: weight_map is empty", index_path);
  return file_of;
}

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// Note [config against weights]
// config.json sizes every tensor the model allocates, and a lying one (hidden_size 131072
// beside a 2 MB model.safetensors) would have the model allocate far more than the files hold
// before the first tensor's shape is compared. So before the model is built, the headers of the
// weight files (read without their data) are held against the config: the embedding, layer 0's
// projections and the last layer name the key that disagrees; and the parameters the sizes
// imply at the least (embedding, attention and MLP weights, nothing else) must fit in the bytes
// the files hold at 2 bytes per weight (the narrowest dtype replica loads; MXFP4 experts at
// 17 bytes per 32). The shapes of every tensor are then checked exactly as it is loaded.
void check_config_against_weights(const LlamaConfig& c, const std::string& config_path,
                                  const std::vector<std::string>& files) {
  std::map<std::string, std::pair<std::vector<int64_t>, std::string>> stored;  // name -> shape, file
  double stored_bytes = 0;
  for (const auto& path : files) {
    for (const auto& t : io::read_safetensors_header(path)) {
      double numel = 1;
      for (int64_t d : t.shape) numel *= static_cast<double>(d);
      stored_bytes += numel * static_cast<double>(c10::elementSize(t.dtype));
      const std::string name = text_parameter_name(t.name, c.wrapper_model_type);
      if (!name.empty()) stored[name] = {t.shape, path};
    }
  }
  // Dimension `dim` of tensor `name` (when the files hold it) must be `want`, which `keys` gave.
  auto expect = [&](const std::string& name, size_t dim, int64_t want, const std::string& keys) {
    const auto it = stored.find(name);
    if (it == stored.end()) return;
    const auto& [shape, file] = it->second;
    if (shape.size() > dim && shape[dim] == want) return;
    fail("{}: {} is {}, but tensor {} in {} has shape {}", config_path, keys, want, name, file, shape_text(shape));
  };
  expect("model.embed_tokens.weight", 0, c.vocab_size, "vocab_size");
  expect("model.embed_tokens.weight", 1, c.hidden_size, "hidden_size");
  const std::string attn = "model.layers.0.self_attn.";
  expect(attn + "q_proj.weight", 0, c.num_attention_heads * c.head_dim, "num_attention_heads x head_dim");
  expect(attn + "q_proj.weight", 1, c.hidden_size, "hidden_size");
  expect(attn + "k_proj.weight", 0, c.num_key_value_heads * c.head_dim, "num_key_value_heads x head_dim");
  if (c.num_local_experts == 0) expect("model.layers.0.mlp.gate_proj.weight", 0, c.intermediate_size, "intermediate_size");
  bool any_layer = false, last_layer = false;
  const std::string last = fmt::format("model.layers.{}.", c.num_hidden_layers - 1);
  for (const auto& [name, shape_file] : stored) {
    any_layer = any_layer || starts_with(name, "model.layers.");
    last_layer = last_layer || starts_with(name, last);
  }
  if (any_layer && !last_layer) {
    fail("{}: num_hidden_layers is {}, but the weight files hold no tensor of layer {} ({}*)", config_path,
         c.num_hidden_layers, c.num_hidden_layers - 1, last);
  }

  const double h = static_cast<double>(c.hidden_size), layers = static_cast<double>(c.num_hidden_layers);
  const double attention = h * static_cast<double>(c.head_dim) * 2.0 *
                           static_cast<double>(c.num_attention_heads + c.num_key_value_heads);
  const double mlp = 3.0 * h * static_cast<double>(c.intermediate_size) *
                     static_cast<double>(std::max<int64_t>(c.num_local_experts, 1));
  const double parameters = static_cast<double>(c.vocab_size) * h + layers * (attention + mlp);
  const double least_bytes =
      2.0 * (static_cast<double>(c.vocab_size) * h + layers * attention) + layers * mlp * (c.mxfp4_experts ? 17.0 / 32 : 2.0);
  if (least_bytes > stored_bytes) {
    fail("{}: its sizes (vocab_size {}, hidden_size {}, intermediate_size {}, num_hidden_layers {}, "
         "num_attention_heads {}, num_key_value_heads {}, head_dim {}{}) imply at least {:.4g} parameters "
         "({:.4g} bytes), but the weight files ({}) hold only {:.4g} bytes",
         config_path, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
         c.num_key_value_heads, c.head_dim,
         c.num_local_experts > 0 ? fmt::format(", num_local_experts {}", c.num_local_experts) : std::string(),
         parameters, least_bytes, fmt::join(files, ", "), stored_bytes);
  }
}

}  // namespace

LlamaConfig read_hf_config(const std::string& dir) {
  if (!fs::is_directory(dir)) fail("{}: not a model directory", dir);
  return read_llama_config_file((fs::path(dir) / "config.json").string());
}

std::vector<std::string> hf_weight_files(const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(single)) return {single.string()};
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (!fs::exists(index_path)) {
    if (fs::exists(fs::path(dir) / "pytorch_model.bin") || fs::exists(fs::path(dir) / "pytorch_model.bin.index.json")) {
      fail("{}: only pytorch_model.bin (pickle) weights found; replica reads safetensors only "
           "(convert with save_pretrained(..., safe_serialization=True))", dir);
    }
    fail("{}: no model.safetensors or model.safetensors.index.json", dir);
  }
  std::set<std::string> files;
  for (const auto& [tensor, file] : read_weight_index(dir)) files.insert(file);
  for (const auto& f : files) {
    if (!fs::exists(f)) fail("{}: shard {} named in {} is missing", dir, f, index_path.string());
  }
  return {files.begin(), files.end()};
}

torch::ScalarType load_hf_weights(LlamaForCausalLM& model, const std::string& dir, const QuantOptions& quant,
                                  HfExtraTensors* extra) {
  const auto files = hf_weight_files(dir);
  // Which shard the index says each tensor is in (checked when the shard is read).
  std::map<std::string, std::string> expected_file;
  if (files.size() > 1 || fs::path(files[0]).filename() != "model.safetensors") expected_file = read_weight_index(dir);

  std::map<std::string, torch::Tensor> params;
  for (const auto& item : model->named_parameters(/*recurse=*/true)) {
    if (!is_lora_name(item.key())) params[item.key()] = item.value();
  }
  // With a quantization, each decoder linear is quantized as soon as its weight is read, and
  // the full-precision copy freed (the model was built with init false: a weight's pages
  // become resident only when copied here), so the whole model is never resident in full
  // precision: at most one weight file plus one layer's weight beside the quantized ones.
  std::map<std::string, std::shared_ptr<LoraLinearImpl>> quantize_on_load;
  if (quant.enabled()) {
    for (auto& [name, layer] : quantizable_linears(*model)) {
      if (!layer->base_quantized()) quantize_on_load[name + ".weight"] = layer;
    }
  }
  const bool tied = model->config().tie_word_embeddings;
  std::set<std::string> loaded;
  std::optional<torch::ScalarType> stored;
  // GPT-OSS's MXFP4 experts: W_blocks and W_scales (maybe in different shards) become W.
  std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> mxfp4;
  torch::NoGradGuard no_grad;
  for (const auto& path : files) {
    auto file = io::load_safetensors(path);
    for (const auto& [stored_name, tensor] : file.tensors) {
      // A gemma3 checkpoint: the text model's weights under Gemma3ForCausalLM's names; the
      // vision tower and projector are not loaded (decoder_family.h: text_parameter_name).
      const std::string name = text_parameter_name(stored_name, model->config().wrapper_model_type);
      if (name.empty()) continue;
      if (model->config().mxfp4_experts && (ends_with(name, "_blocks") || ends_with(name, "_scales"))) {
        const bool blocks = ends_with(name, "_blocks");
        const std::string base = name.substr(0, name.size() - 7);
        auto& pair = mxfp4[base];
        (blocks ? pair.first : pair.second) = tensor;
        if (!pair.first.defined() || !pair.second.defined()) continue;
        auto it = params.find(base);
        if (it == params.end()) fail("{}: MXFP4 tensor {} is not a parameter of this model", path, base);
        auto w = dequantize_mxfp4(pair.first, pair.second, it->second.scalar_type(), path + ": " + base);
        if (w.sizes() != it->second.sizes()) {
          fail("{}: MXFP4 tensor {} dequantizes to shape {}, config.json implies {}", path, base,
               c10::str(w.sizes()), c10::str(it->second.sizes()));
        }
        it->second.copy_(w);
        pair = {};
        if (!loaded.insert(base).second) fail("{}: tensor {} appears more than once", path, base);
        continue;
      }
      if (ends_with(name, "rotary_emb.inv_freq")) continue;    // old checkpoints saved this buffer
      if (tied && name == "lm_head.weight") continue;          // the embedding is the head
      auto it = params.find(name);
      if (it == params.end() && extra && extra->take.count(name)) {
        if (!extra->taken.emplace(name, tensor).second) fail("{}: tensor {} appears in more than one weight file", path, name);
        continue;
      }
      if (it == params.end()) {
        fail("{}: tensor {} is not a parameter of this {} model (unsupported architecture variant?)", path, name,
             model->config().model_type);
      }
      const auto dt = tensor.scalar_type();
      if (dt != torch::kFloat32 && dt != torch::kBFloat16 && dt != torch::kFloat16) {
        fail("{}: tensor {} has dtype {}; weights must be float32, bfloat16 or float16", path, name,
             c10::toString(dt));
      }
      if (tensor.sizes() != it->second.sizes()) {
        fail("{}: tensor {} has shape {}, config.json implies {}", path, name, c10::str(tensor.sizes()),
             c10::str(it->second.sizes()));
      }
      if (!loaded.insert(name).second) fail("{}: tensor {} appears in more than one weight file", path, name);
      if (!stored) stored = dt;
      it->second.copy_(tensor);
      if (auto q = quantize_on_load.find(name); q != quantize_on_load.end()) {
        it->second = torch::Tensor();  // this map's handle: the layer's goes in quantize_base
        q->second->quantize_base(quant);
      }
    }
    for (const auto& [tensor, shard] : expected_file) {
      if (shard == path && !file.contains(tensor)) {
        fail("{}: tensor {} is missing (model.safetensors.index.json places it in this shard)", path, tensor);
      }
    }
  }
  for (const auto& [base, pair] : mxfp4) {
    if (pair.first.defined() != pair.second.defined()) {
      fail("{}: MXFP4 tensor {} has its {} but no {} in {}", dir, base, pair.first.defined() ? "_blocks" : "_scales",
           pair.first.defined() ? "_scales" : "_blocks", fmt::join(files, ", "));
    }
  }
  for (const auto& [name, tensor] : params) {
    if (!loaded.count(name) && !(extra && extra->may_be_missing.count(name))) {
      fail("{}: weight {} is missing from {}", dir, name, fmt::join(files, ", "));
    }
  }
  // The embeddings and an untied head, once read whole (models/llama.cpp: Note [quantized embeddings]).
  if (quant.enabled() && quant.embeddings) model->quantize_embeddings(quant);
  model->set_checkpoint_dtype(stored.value_or(torch::kFloat32));
  return model->checkpoint_dtype();
}

LlamaForCausalLM load_hf_model(const std::string& dir, torch::ScalarType dtype, const QuantOptions& quant,
                               HfExtraTensors* extra) {
  LlamaConfig config = read_hf_config(dir);
  // Before anything is allocated: Note [config against weights].
  check_config_against_weights(config, (fs::path(dir) / "config.json").string(), hf_weight_files(dir));
  LlamaForCausalLM model(config, dtype, /*init=*/false);
  load_hf_weights(model, dir, quant, extra);
  return model;
}

io::NamedTensors hf_state_dict(const LlamaForCausalLM& model, std::optional<torch::ScalarType> dtype) {
  if (has_lora(*model)) {
    fail("the model has LoRA adapters attached: merge them (merge_lora) or save the adapter instead");
  }
  if (has_quantized_base(*model)) {
    // Its decoder weights are codes, not parameters: a model directory needs the real weights.
    fail("the model's base is quantized: save its adapter, or the unquantized base it was loaded from");
  }
  const auto target = dtype.value_or(model->checkpoint_dtype());
  io::NamedTensors out;
  for (const auto& item : model->named_parameters(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value().detach().to(torch::kCPU, target).contiguous());
  }
  return out;
}

void save_hf_model_dir(const LlamaForCausalLM& model, const std::string& out_dir, const std::string& source_dir,
                       std::optional<torch::ScalarType> dtype) {
  const auto target = dtype.value_or(model->checkpoint_dtype());
  const std::string dtype_name = dtype_to_string(target);
  std::error_code ec;
  if (!source_dir.empty()) {
    if (!fs::is_directory(source_dir)) fail("{}: not a model directory", source_dir);
    if (fs::exists(out_dir) && fs::equivalent(out_dir, source_dir, ec)) {
      fail("{}: cannot save a model over the directory it was loaded from", out_dir);
    }
  }
  auto tensors = hf_state_dict(model, target);
  fs::create_directories(out_dir, ec);
  if (ec) fail("{}: cannot create directory: {}", out_dir, ec.message());
  const fs::path out(out_dir);

  io::save_safetensors((out / "model.safetensors").string(), tensors, {{"format", "pt"}});
  // A stale index from an earlier sharded save would point loaders at old shards.
  fs::remove(out / "model.safetensors.index.json", ec);

  bool copied_config = false;
  if (!source_dir.empty() && fs::exists(fs::path(source_dir) / "config.json")) {
    const auto source_config = read_llama_config_file((fs::path(source_dir) / "config.json").string());
    // A gemma3 source: its text model's config (the weights saved are the text model's).
    // Written anew also for MXFP4 experts: the saved ones are dequantized (no quantization_config).
    if (source_config.wrapper_model_type.empty() && !source_config.mxfp4_experts &&
        (source_config.torch_dtype == dtype_name ||
        (source_config.torch_dtype == "float" && dtype_name == "float32"))) {
      copy_file_atomically((fs::path(source_dir) / "config.json").string(), (out / "config.json").string());
      copied_config = true;
    } else {
      LlamaConfig c = source_config;
      c.torch_dtype = dtype_name;
      write_file_atomically((out / "config.json").string(), c.to_json_string());
      copied_config = true;
    }
  }
  if (!copied_config) {
    LlamaConfig c = model->config();
    c.torch_dtype = dtype_name;
    write_file_atomically((out / "config.json").string(), c.to_json_string());
  }
  if (!source_dir.empty()) {
    for (const auto& entry : fs::directory_iterator(source_dir)) {
      const std::string name = entry.path().filename().string();
      if (entry.is_regular_file() && is_carried_file(name)) copy_file_atomically(entry.path().string(), (out / name).string());
    }
  }
}

void merge_adapter_dir(const std::string& model_dir, const std::string& adapter_dir, const std::string& out_dir) {
  // Merge in fp32 from the stored weights (exact for bf16/fp16 checkpoints), round once on save.
  auto model = load_hf_model(model_dir, torch::kFloat32);
  load_adapter(*model, adapter_dir);
  merge_lora(*model);
  save_hf_model_dir(model, out_dir, model_dir);
}

LlamaConfig make_tiny_llama(const std::string& dir, int64_t vocab_size, const TinyLlamaOptions& o) {
  if (vocab_size < 1) fail("make_tiny_llama: vocab_size must be at least 1, got {}", vocab_size);
  if (o.hidden_size % o.num_attention_heads != 0 || o.num_attention_heads % o.num_key_value_heads != 0 ||
      (o.hidden_size / o.num_attention_heads) % 2 != 0) {
    fail("make_tiny_llama: hidden_size {}, num_attention_heads {}, num_key_value_heads {} do not fit together",
         o.hidden_size, o.num_attention_heads, o.num_key_value_heads);
  }
  LlamaConfig c;
  c.model_type = "llama";
  c.vocab_size = vocab_size;
  c.hidden_size = o.hidden_size;
  c.intermediate_size = o.intermediate_size;
  c.num_hidden_layers = o.num_hidden_layers;
  c.num_attention_heads = o.num_attention_heads;
  c.num_key_value_heads = o.num_key_value_heads;
  c.head_dim = o.hidden_size / o.num_attention_heads;
  c.rms_norm_eps = o.rms_norm_eps;
  c.rope_theta = o.rope_theta;
  c.max_position_embeddings = o.max_position_embeddings;
  c.tie_word_embeddings = o.tie_word_embeddings;
  c.bos_token_id = o.bos_token_id;
  c.eos_token_ids = o.eos_token_ids;
  c.pad_token_id = o.pad_token_id;
  c.torch_dtype = dtype_to_string(o.dtype);
  c.initializer_range = 0.02;
  // Round trip through the parser so the written config is exactly what a load will see.
  c = parse_llama_config(c.to_json_string(), "make_tiny_llama config");
  c.json_text.clear();

  LlamaForCausalLM model(c, torch::kFloat32, /*init=*/false);
  {
    // HF's _init_weights, from a private generator: N(0, initializer_range) for linear and
    // embedding weights, zero biases, ones for the RMSNorm weights, pad row zero.
    torch::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
    for (auto& item : model->named_parameters(true)) {
      const std::string& name = item.key();
      if (ends_with(name, "norm.weight")) {
        item.value().fill_(1.0);
      } else if (ends_with(name, ".bias")) {
        item.value().zero_();
      } else {
        item.value().normal_(0.0, c.initializer_range, gen);
      }
    }
    if (c.pad_token_id) model->model->embed_tokens->weight[*c.pad_token_id].zero_();
  }
  model->set_checkpoint_dtype(o.dtype);
  save_hf_model_dir(model, dir, "", o.dtype);

  json gen_config;
  gen_config["_from_model_config"] = true;
  gen_config["bos_token_id"] = c.bos_token_id ? json(*c.bos_token_id) : json(nullptr);
  if (c.eos_token_ids.size() == 1) {
    gen_config["eos_token_id"] = c.eos_token_ids[0];
  } else if (c.eos_token_ids.empty()) {
    gen_config["eos_token_id"] = nullptr;
  } else {
    gen_config["eos_token_id"] = c.eos_token_ids;
  }
  if (c.pad_token_id) gen_config["pad_token_id"] = *c.pad_token_id;
  write_file_atomically((fs::path(dir) / "generation_config.json").string(), gen_config.dump(2) + "\n");
  return c;
}

}  // namespace replica::models
