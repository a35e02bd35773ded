// Hostile model directories: every file a model is read from (config.json, the weights, the
// shard index, adapter_config.json, the adapter's weights) refused with one line naming the
// file and what is wrong: never a hang (a FIFO), a crash (JSON nested 10^6 deep), an
// allocation sized by a lying number (hidden_size 1e12), or a NaN weight accepted silently.
#include "replica/io/safetensors.h"
#include "replica/models/hf_model_dir.h"
#include "replica/models/lora.h"
#include "replica/models/tests/test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include <cmath>
#include <string>

namespace replica::models {
namespace {

using json = nlohmann::json;
using namespace replica::models::testing;

// A copy of a reference fixture (a tiny model in real HF layout) to edit.
struct ModelCopy {
  TempDir tmp;
  std::string dir;
  explicit ModelCopy(const std::string& fixture_name, const std::string& tag) : tmp(tag) {
    fs::copy(fixture(fixture_name), tmp.path / "m");
    dir = tmp.str("m");
  }
  std::string config_path() const { return dir + "/config.json"; }
  json config() const { return json::parse(read_text(config_path())); }
  void write_config(const json& j) const { write_text(config_path(), j.dump()); }
};

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const replica::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(HostileModelFiles, ConfigJsonNestedAMillionDeepIsRefusedNamingIt) {
  ModelCopy m("llama3_gqa", "deep");
  const int depth = 1000000;
  write_text(m.config_path(), R"({"model_type": "llama", "x": )" + std::string(depth, '[') +
                                  std::string(depth, ']') + "}");
  EXPECT_EQ(error_in_child([&] { read_hf_config(m.dir); }),
            m.config_path() + ": JSON nested more than 128 levels deep");
}

TEST(HostileModelFiles, AFifoInPlaceOfAnyModelFileIsRefusedWithoutBlocking) {
  const std::string fifo_message = "is a FIFO (named pipe), not a regular file: replica reads only regular files";
  {
    ModelCopy m("llama3_gqa", "fifo_config");
    fs::remove(m.config_path());
    ASSERT_EQ(::mkfifo(m.config_path().c_str(), 0600), 0);
    EXPECT_EQ(error_in_child([&] { read_hf_config(m.dir); }), "'" + m.config_path() + "' " + fifo_message);
  }
  {
    ModelCopy m("llama3_gqa", "fifo_weights");
    const std::string weights = m.dir + "/model.safetensors";
    fs::remove(weights);
    ASSERT_EQ(::mkfifo(weights.c_str(), 0600), 0);
    EXPECT_EQ(error_in_child([&] { load_hf_model(m.dir); }), "'" + weights + "' " + fifo_message);
  }
  {
    ModelCopy m("llama_tied_bf16_sharded", "fifo_index");
    const std::string index = m.dir + "/model.safetensors.index.json";
    fs::remove(index);
    ASSERT_EQ(::mkfifo(index.c_str(), 0600), 0);
    EXPECT_EQ(error_in_child([&] { hf_weight_files(m.dir); }), "'" + index + "' " + fifo_message);
  }
  {
    TempDir tmp("fifo_adapter");
    fs::create_directories(tmp.path / "a");
    ASSERT_EQ(::mkfifo(tmp.str("a/adapter_config.json").c_str(), 0600), 0);
    EXPECT_EQ(error_in_child([&] { read_adapter_config(tmp.str("a")); }),
              "'" + tmp.str("a/adapter_config.json") + "' " + fifo_message);
  }
}

TEST(HostileModelFiles, ConfigJsonLinkedToDevZeroIsRefusedBeforeReading) {
  ModelCopy m("llama3_gqa", "devzero");
  fs::remove(m.config_path());
  fs::create_symlink("/dev/zero", m.config_path());
  EXPECT_EQ(error_in_child([&] { read_hf_config(m.dir); }),
            "'" + m.config_path() + "' is a character device, not a regular file: replica reads only regular files");
}

TEST(HostileModelFiles, EverySizeKeyOutsideItsBoundIsRefusedNamingConfigJsonAndTheKey) {
  ModelCopy m("llama3_gqa", "sizes");
  const json good = m.config();
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "max_position_embeddings"}) {
    for (const json& value : {json(1e12), json(uint64_t{18446744073709551615ULL}), json(-4), json(0)}) {
      json j = good;
      j[key] = value;
      m.write_config(j);
      const std::string message = error_of([&] { read_hf_config(m.dir); });
      EXPECT_EQ(message.rfind(m.config_path() + ": " + key + " must be between 1 and ", 0), 0u)
          << key << " = " << value.dump() << ": " << message;
    }
  }
  json j = good;
  j["rope_scaling"]["original_max_position_embeddings"] = 1e15;
  m.write_config(j);
  EXPECT_NE(error_of([&] { read_hf_config(m.dir); }).find("original_max_position_embeddings must be between 1 and"),
            std::string::npos);
  j = good;
  j["hidden_size"] = 1e12;
  m.write_config(j);
  EXPECT_EQ(error_of([&] { load_hf_model(m.dir); }),
            m.config_path() + ": hidden_size must be between 1 and 131072, got 1000000000000.0");
}

// Sizes within their bounds but unlike the weights: refused before the model is built, naming
// config.json's key and the tensor that disagrees (before, the model was allocated at the
// config's sizes and the first copy's shape check named only the tensor).
TEST(HostileModelFiles, SizesUnlikeTheWeightsAreRefusedBeforeTheModelIsBuilt) {
  ModelCopy m("llama3_gqa", "lying");
  const json good = m.config();
  const std::string weights = m.dir + "/model.safetensors";
  struct Case {
    const char* key;
    int64_t value;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"hidden_size", 131072,
       ": hidden_size is 131072, but tensor model.embed_tokens.weight in " + weights + " has shape [96, 32]"},
      {"vocab_size", 8000000,
       ": vocab_size is 8000000, but tensor model.embed_tokens.weight in " + weights + " has shape [96, 32]"},
      {"intermediate_size", 1000000,
       ": intermediate_size is 1000000, but tensor model.layers.0.mlp.gate_proj.weight in " + weights +
           " has shape [64, 32]"},
      {"num_attention_heads", 4096,
       ": num_attention_heads x head_dim is 32768, but tensor model.layers.0.self_attn.q_proj.weight in " + weights +
           " has shape [32, 32]"},
      {"num_hidden_layers", 4000,
       ": num_hidden_layers is 4000, but the weight files hold no tensor of layer 3999 (model.layers.3999.*)"},
  };
  for (const auto& c : cases) {
    json j = good;
    j[c.key] = c.value;
    if (std::string(c.key) == "num_attention_heads") j["num_key_value_heads"] = c.value;
    m.write_config(j);
    EXPECT_EQ(error_of([&] { load_hf_model(m.dir); }), m.config_path() + c.expected) << c.key;
  }
  // Without the tensors that name a key, the bytes the files hold bound what the sizes imply.
  replica::io::save_safetensors(weights, {{"model.norm.weight", torch::ones({32})}});
  json j = good;
  j["hidden_size"] = 65536;
  j["intermediate_size"] = 65536;
  m.write_config(j);
  const std::string message = error_of([&] { load_hf_model(m.dir); });
  EXPECT_EQ(message.rfind(m.config_path() + ": its sizes (vocab_size 96, hidden_size 65536, intermediate_size 65536, "
                                            "num_hidden_layers 2, num_attention_heads 4, num_key_value_heads 2, "
                                            "head_dim 8) imply at least ",
                          0),
            0u)
      << message;
  EXPECT_NE(message.find("but the weight files (" + weights + ") hold only 128 bytes"), std::string::npos) << message;
}

TEST(HostileModelFiles, NonFiniteWeightsAreRefusedAtLoadNamingTheTensorAndTheFile) {
  {
    ModelCopy m("llama3_gqa", "nan");
    const std::string weights = m.dir + "/model.safetensors";
    auto tensors = replica::io::load_safetensors(weights).tensors;
    for (auto& [name, t] : tensors) {
      if (name == "model.layers.1.mlp.down_proj.weight") t.view({-1})[5] = std::nan("");
    }
    replica::io::save_safetensors(weights, tensors);
    EXPECT_EQ(error_of([&] { load_hf_model(m.dir); }),
              weights + ": tensor 'model.layers.1.mlp.down_proj.weight' holds NaN at element 5 (of shape [32, 64]): "
                        "replica refuses non-finite weights and state");
  }
  {
    ModelCopy m("llama_tied_bf16_sharded", "inf_shard");
    const std::string shard = m.dir + "/model-00002-of-00003.safetensors";
    auto tensors = replica::io::load_safetensors(shard).tensors;
    ASSERT_FALSE(tensors.empty());
    tensors.back().second.view({-1})[0] = -INFINITY;
    replica::io::save_safetensors(shard, tensors);
    EXPECT_EQ(error_of([&] { load_hf_model(m.dir); }),
              shard + ": tensor '" + tensors.back().first + "' holds -inf at element 0 (of shape " +
                  c10::str(tensors.back().second.sizes()) + "): replica refuses non-finite weights and state");
  }
}

TEST(HostileModelFiles, AdaptersAreHeldToTheirBoundsTheirFileAndFiniteValues) {
  TempDir tmp("hostile_adapter");
  auto model = load_hf_model(fixture("llama3_gqa"));
  LoraConfig config;
  config.r = 2;
  apply_lora(*model, config);
  save_adapter(*model, config, tmp.str("a"));
  const std::string config_path = tmp.str("a/adapter_config.json");
  const std::string weights = tmp.str("a/adapter_model.safetensors");
  const json good = json::parse(read_text(config_path));

  auto fresh = [] { return load_hf_model(fixture("llama3_gqa")); };
  json j = good;
  j["r"] = 1e12;
  write_text(config_path, j.dump());
  EXPECT_EQ(error_of([&] { read_adapter_config(tmp.str("a")); }),
            config_path + ": r must be between 1 and 65536, got 1000000000000.0");
  // Within the bound but unlike the file: refused before any adapter matrix is allocated.
  j["r"] = 4096;
  write_text(config_path, j.dump());
  auto m1 = fresh();
  EXPECT_EQ(error_of([&] { load_adapter(*m1, tmp.str("a")); }).rfind(config_path + ": r is 4096, but tensor ", 0), 0u);
  write_text(config_path, good.dump());

  auto tensors = replica::io::load_safetensors(weights).tensors;
  tensors.front().second.view({-1})[1] = std::nan("");
  replica::io::save_safetensors(weights, tensors);
  auto m2 = fresh();
  EXPECT_EQ(error_of([&] { load_adapter(*m2, tmp.str("a")); }),
            weights + ": tensor '" + tensors.front().first + "' holds NaN at element 1 (of shape " +
                c10::str(tensors.front().second.sizes()) + "): replica refuses non-finite weights and state");

  j = good;
  j["target_modules"] = json::array({json(std::string(1 << 20, 'q'))});
  j["peft_type"] = std::string(1 << 20, 'P');
  write_text(config_path, j.dump());
  const std::string message = error_of([&] { read_adapter_config(tmp.str("a")); });
  EXPECT_LT(message.size(), 300u) << message.substr(0, 300);
}

}  // namespace
}  // namespace replica::models
