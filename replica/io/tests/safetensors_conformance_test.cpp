// Conformance: replica's safetensors files against the safetensors package, with transformers
// and PEFT saying what names and dtypes must be.
//
// - Python's safetensors (safe_open and safetensors.torch.load_file) reads every file the
//   `replica` program writes in real runs on tiny Llama models that transformers made (float32
//   with a separate lm_head, bfloat16 with tied embeddings): checkpoints (model or adapter,
//   optimizer, rng state), final/ (a transformers model directory, or a PEFT adapter), merged/
//   (merge_adapter), ZeRO-3 shards at world 2 and `replica consolidate`'s output. Full models
//   carry the names transformers' save_pretrained writes, in the base model's dtype (final/,
//   merged/; they load with from_pretrained, no key missing or unexpected) or float32
//   (checkpoints, consolidate); adapters PEFT's names and dtypes; every floating tensor is
//   finite (referee/safetensors_referee.py check).
// - replica's reader (replica/io/safetensors.h) reads a file safetensors.torch.save_file wrote
//   with every dtype replica supports, values bit for bit (NaN, infinities, -0, subnormals,
//   integer extremes), shapes (0-d, empty) and __metadata__.
#include "replica/io/safetensors.h"
#include "replica/testing/paths.h"
#include "replica/testing/referee.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct TempDir : replica::testing::ScratchDir {
  TempDir() : ScratchDir("replica-safetensors-conformance") {}
};

const fs::path kReferee = fs::path(REPLICA_SOURCE_DIR) / "replica/io/tests/referee/safetensors_referee.py";

// The referee's inputs (two tiny transformers models, a data set, the every-dtype file), made
// once for the tests of this file.
struct Inputs {
  TempDir dir;
  replica::testing::PythonRun made;
  fs::path root() const { return dir.path; }
};
const Inputs& inputs() {
  static const std::unique_ptr<Inputs> in = [] {
    auto i = std::make_unique<Inputs>();
    i->made = replica::testing::run_python(kReferee, {"make-inputs", i->dir.path.string()});
    return i;
  }();
  return *in;
}

replica::testing::Result replica_run(const std::vector<std::string>& args) {
  return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(240));
}

// A short `replica llm --train` run: 3 optimizer steps of 2 rows, a checkpoint at step 2.
replica::testing::Result train(const fs::path& model, const fs::path& project, std::vector<std::string> extra) {
  std::vector<std::string> args = {"llm", "--train", "--model", model.string(), "--data-path",
                                   (inputs().root() / "data.jsonl").string(), "--project-name", project.string(),
                                   "--trainer", "sft", "--threads-per-worker", "1", "--batch-size", "2",
                                   "--gradient-accumulation", "1", "--block-size", "48", "--lr", "1e-3",
                                   "--warmup-ratio", "0", "--max-steps", "3", "--checkpoint-every", "2",
                                   "--save-total-limit", "2", "--logging-steps", "1"};
  args.insert(args.end(), extra.begin(), extra.end());
  return replica_run(args);
}

replica::testing::PythonRun check(const json& manifest) {
  static int calls = 0;
  const fs::path file = inputs().root() / ("manifest-" + std::to_string(++calls) + ".json");
  std::ofstream(file) << manifest.dump(2);
  return replica::testing::run_python(kReferee, {"check", file.string()});
}

torch::ScalarType dtype_of(const std::string& name) {
  static const std::map<std::string, torch::ScalarType> types = {
      {"F64", torch::kFloat64}, {"F32", torch::kFloat32}, {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16},
      {"I64", torch::kInt64},   {"I32", torch::kInt32},   {"I16", torch::kInt16},   {"I8", torch::kInt8},
      {"U8", torch::kUInt8},    {"BOOL", torch::kBool}};
  return types.at(name);
}

}  // namespace

TEST(SafetensorsConformance, ReplicaReadsWhatPythonWritesInEveryDtype) {
  REPLICA_REQUIRE_PYTHON("safetensors", "torch", "tokenizers", "transformers");
  ASSERT_EQ(inputs().made.exit_code, 0) << inputs().made.output;
  std::ifstream expected_stream(inputs().root() / "dtypes.json");
  const json expected = json::parse(expected_stream);
  // NaN and infinities are among the values read back bit for bit: kKeep (weights refuse them).
  const auto file = replica::io::load_safetensors((inputs().root() / "dtypes.safetensors").string(),
                                                  replica::io::NonFinite::kKeep);

  using Metadata = std::map<std::string, std::string>;
  EXPECT_EQ(file.metadata, expected["metadata"].get<Metadata>());
  ASSERT_EQ(file.tensors.size(), expected["tensors"].size());
  for (const auto& [name, want] : expected["tensors"].items()) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(file.contains(name));
    const torch::Tensor& t = file.at(name);
    EXPECT_EQ(t.scalar_type(), dtype_of(want["dtype"].get<std::string>()));
    EXPECT_EQ(t.sizes().vec(), want["shape"].get<std::vector<int64_t>>());
    const json& values = want["values"];
    ASSERT_EQ(t.numel(), static_cast<int64_t>(values.size()));
    const torch::Tensor flat = t.reshape({-1});
    for (int64_t i = 0; i < t.numel(); ++i) {
      const json& v = values[static_cast<size_t>(i)];
      if (t.is_floating_point()) {
        const double got = flat[i].item<double>();
        if (v.is_string()) {
          const std::string s = v.get<std::string>();
          if (s == "nan") EXPECT_TRUE(std::isnan(got)) << i;
          else EXPECT_EQ(got, s == "inf" ? INFINITY : -INFINITY) << i;
        } else {
          EXPECT_EQ(got, v.get<double>()) << i;
          EXPECT_EQ(std::signbit(got), want["negative_zero"][static_cast<size_t>(i)].get<int>() == 1 || got < 0) << i;
        }
      } else if (t.scalar_type() == torch::kBool) {
        EXPECT_EQ(flat[i].item<bool>(), v.get<bool>()) << i;
      } else {
        EXPECT_EQ(flat[i].item<int64_t>(), v.get<int64_t>()) << i;
      }
    }
  }
}

TEST(SafetensorsConformance, PythonReadsEveryFileOfFullAndLoraRuns) {
  REPLICA_REQUIRE_PYTHON("safetensors", "torch", "tokenizers", "transformers", "peft");
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  ASSERT_EQ(inputs().made.exit_code, 0) << inputs().made.output;
  const fs::path fp32 = inputs().root() / "llama-fp32", bf16 = inputs().root() / "llama-bf16";
  const fs::path runs = inputs().root() / "runs";
  struct Run {
    std::string name;
    fs::path model;
    std::vector<std::string> flags;
  };
  const std::vector<Run> all = {
      {"full-fp32", fp32, {"--mixed-precision", "fp32"}},
      {"lora-fp32", fp32, {"--mixed-precision", "fp32", "--peft", "--lora-r", "4", "--lora-alpha", "8",
                           "--merge-adapter"}},
      {"full-bf16", bf16, {"--mixed-precision", "bf16"}},
      {"lora-bf16", bf16, {"--mixed-precision", "bf16", "--peft", "--lora-r", "4", "--lora-alpha", "8",
                           "--target-modules", "q_proj,v_proj", "--merge-adapter"}},
  };
  json manifest = {{"runs", json::array()}};
  for (const auto& run : all) {
    const fs::path project = runs / run.name;
    std::vector<std::string> flags = run.flags;
    flags.insert(flags.end(), {"--nproc-per-node", "1"});
    const auto r = train(run.model, project, flags);
    ASSERT_EQ(r.exit_code, 0) << run.name << ": " << r;
    ASSERT_TRUE(fs::exists(project / "checkpoint-2")) << run.name << ": " << r;
    manifest["runs"].push_back({{"dir", project.string()}, {"base_model", run.model.string()}});
  }
  const auto referee = check(manifest);
  EXPECT_EQ(referee.exit_code, 0) << referee.output;
  std::cerr << referee.output;
}

TEST(SafetensorsConformance, PythonReadsZero3ShardsAndTheConsolidatedModel) {
  REPLICA_REQUIRE_PYTHON("safetensors", "torch", "tokenizers", "transformers", "peft");
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  ASSERT_EQ(inputs().made.exit_code, 0) << inputs().made.output;
  const fs::path fp32 = inputs().root() / "llama-fp32";
  const fs::path project = inputs().root() / "runs-zero3" / "full-zero3";
  const auto r = train(fp32, project, {"--mixed-precision", "fp32", "--distributed-backend", "zero3",
                                       "--nproc-per-node", "2"});
  ASSERT_EQ(r.exit_code, 0) << r;
  ASSERT_TRUE(fs::exists(project / "checkpoint-2" / "zero")) << r;
  const fs::path consolidated = inputs().root() / "runs-zero3" / "consolidated.safetensors";
  const auto c = replica_run({"consolidate", (project / "checkpoint-2").string(), consolidated.string()});
  ASSERT_EQ(c.exit_code, 0) << c;
  const json manifest = {
      {"runs", json::array({{{"dir", project.string()}, {"base_model", fp32.string()}}})},
      {"extra", json::array({{{"file", consolidated.string()}, {"base_model", fp32.string()}, {"kind", "full"}}})}};
  const auto referee = check(manifest);
  EXPECT_EQ(referee.exit_code, 0) << referee.output;
  std::cerr << referee.output;
}
