// QLoRA through the real program (REPLICA_BIN) on the demo of `replica llm init-demo`:
// `--quantization int4|int8` trains LoRA adapters over a quantized base (models/quant.h), the
// adapter it writes loads onto the unquantized base, `--eval` evaluates it over either, and the
// settings that cannot go with a quantized base are refused before any worker starts.
#include "replica/models/hf_model_dir.h"
#include "replica/testing/paths.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/testing/program_runner.h"
#include "replica/tasks/llm_sft/llm_sft.h"
#include "replica/train/tests/tensor_files.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using replica::testing::Result;

namespace {

class QuantizedSft : public replica::testing::ScratchDirTest {
 protected:
  QuantizedSft() : ScratchDirTest("replica-qlora") {}
  void SetUp() override {
    ScratchDirTest::SetUp();
    ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
    demo_ = replica::train::write_llm_demo((dir_ / "demo").string());
  }

  Result replica(const std::vector<std::string>& args) {
    return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(240));
  }

  // `replica llm --train --peft` on the demo, a short schedule, `extra` appended.
  Result train(const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"llm", "--train", "--model", demo_.model_dir, "--data-path", demo_.data_dir,
                                     "--project-name", (dir_ / name).string(), "--trainer", "sft", "--peft",
                                     "--lr", "5e-3", "--block-size", "128", "--batch-size", "2",
                                     "--gradient-accumulation", "1", "--max-steps", "12", "--warmup-ratio", "0",
                                     "--logging-steps", "1", "--checkpoint-every", "0", "--threads-per-worker", "1",
                                     "--seed", "7"};
    args.insert(args.end(), extra.begin(), extra.end());
    return replica(args);
  }

  std::vector<double> losses(const std::string& name) {
    std::vector<double> out;
    std::istringstream in(replica::testing::read_file(dir_ / name / "metrics.jsonl"));
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      const auto j = json::parse(line);
      if (j.contains("loss")) out.push_back(j["loss"].get<double>());
    }
    return out;
  }

  double eval_loss(const std::string& adapter, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"llm", "--eval", "--model", demo_.model_dir, "--data-path",
                                     demo_.data_dir + "/valid.jsonl", "--adapter", adapter};
    args.insert(args.end(), extra.begin(), extra.end());
    const Result r = replica(args);
    EXPECT_EQ(r.exit_code, 0) << r;
    const auto at = r.out.find("eval_loss: ");
    return at == std::string::npos ? -1 : std::stod(r.out.substr(at + 11));
  }

  replica::train::LlmDemo demo_;
};

}  // namespace

// The same short run unquantized, int4 and int8 (one worker, fp32): the quantized runs train
// (the loss falls like the unquantized run's), say what the base holds, and write the same PEFT
// adapter (names, shapes, fp32, adapter_config.json) that loads onto the unquantized base.
TEST_F(QuantizedSft, Int4AndInt8TrainAdaptersThatLoadOnTheUnquantizedBase) {
  const Result plain = train("none", {"--nproc-per-node", "1"});
  ASSERT_EQ(plain.exit_code, 0) << plain;
  const auto plain_losses = losses("none");
  ASSERT_EQ(plain_losses.size(), 12u);
  const auto plain_adapter = replica::testing::load_tensors(dir_ / "none" / "final" / "adapter_model.safetensors");
  for (const std::string q : {"int4", "int8"}) {
    SCOPED_TRACE(q);
    const Result r = train(q, {"--nproc-per-node", "1", "--quantization", q});
    ASSERT_EQ(r.exit_code, 0) << r;
    EXPECT_NE(r.err.find(q == "int4" ? "base quantized to nf4 (blocks of 64, double-quantized absmax): 28 weights "
                                       "(decoder linears)"
                                     : "base quantized to int8 (per-row absmax): 28 weights (decoder linears)"),
              std::string::npos)
        << r;
    const auto l = losses(q);
    ASSERT_EQ(l.size(), 12u);
    for (double x : l) EXPECT_TRUE(std::isfinite(x));
    // The first step sees the base alone (B = 0): the quantization error of the base is all
    // that differs. Later, the runs stay close: NF4's error is of the order of the weights'
    // relative error (~0.1) on this model's small decoder contribution.
    EXPECT_NEAR(l.front(), plain_losses.front(), q == "int4" ? 0.1 : 0.01);
    EXPECT_LT(l.back(), l.front() - 0.5);
    EXPECT_NEAR(l.back(), plain_losses.back(), q == "int4" ? 0.3 : 0.05);
    std::printf("[qlora %s] loss step 1 %.4f (unquantized %.4f), step 12 %.4f (unquantized %.4f)\n", q.c_str(),
                l.front(), plain_losses.front(), l.back(), plain_losses.back());

    const fs::path final_dir = dir_ / q / "final";
    const auto adapter = replica::testing::load_tensors(final_dir / "adapter_model.safetensors");
    ASSERT_EQ(adapter.size(), plain_adapter.size());
    for (const auto& [name, t] : plain_adapter) {
      ASSERT_TRUE(adapter.count(name)) << name;
      EXPECT_EQ(adapter.at(name).sizes(), t.sizes()) << name;
      EXPECT_EQ(adapter.at(name).scalar_type(), torch::kFloat32) << name;
    }
    EXPECT_EQ(replica::testing::read_file(final_dir / "adapter_config.json"),
              replica::testing::read_file(dir_ / "none" / "final" / "adapter_config.json"));
    // Onto the unquantized base, in process (PEFT does the same: peft_conformance_test.cpp).
    auto model = replica::models::load_hf_model(demo_.model_dir);
    EXPECT_NO_THROW(replica::models::load_adapter(*model, final_dir.string()));
  }
}

TEST_F(QuantizedSft, EvalTakesTheAdapterOverTheUnquantizedOrTheQuantizedBase) {
  const Result r = train("int4", {"--nproc-per-node", "1", "--quantization", "int4", "--max-steps", "20"});
  ASSERT_EQ(r.exit_code, 0) << r;
  const std::string adapter = (dir_ / "int4" / "final").string();
  const Result base = replica({"llm", "--eval", "--model", demo_.model_dir, "--data-path",
                               demo_.data_dir + "/valid.jsonl"});
  ASSERT_EQ(base.exit_code, 0) << base;
  const double base_loss = std::stod(base.out.substr(base.out.find("eval_loss: ") + 11));
  const double over_plain = eval_loss(adapter, {});
  const double over_quantized = eval_loss(adapter, {"--quantization", "int4"});
  EXPECT_LT(over_plain, base_loss - 0.5);
  EXPECT_LT(over_quantized, base_loss - 0.5);
  EXPECT_NEAR(over_plain, over_quantized, 0.3);
  EXPECT_NE(over_plain, over_quantized);
  std::printf("[qlora int4, 20 steps] eval_loss base %.4f; adapter over the unquantized base %.4f, over the int4 "
              "base %.4f\n",
              base_loss, over_plain, over_quantized);
}

// --quantize-embeddings: the embeddings and the head in NF4 too. The run trains close to the
// unquantized one, the whole base falls under 0.3x fp16 (the log says so), the adapter loads on
// the unquantized base, and --eval takes the same two flags.
TEST_F(QuantizedSft, QuantizedEmbeddingsTrainAndTheWholeBaseIsUnderAThirdOfFp16) {
  const Result plain = train("none", {"--nproc-per-node", "1"});
  ASSERT_EQ(plain.exit_code, 0) << plain;
  const Result r = train("int4e", {"--nproc-per-node", "1", "--quantization", "int4", "--quantize-embeddings"});
  ASSERT_EQ(r.exit_code, 0) << r;
  const std::string said = "weights (decoder linears, embeddings, head) in ";
  const auto at = r.err.find(said);
  ASSERT_NE(at, std::string::npos) << r;
  // "... the whole base X MiB (R x fp16; norms in float32)"
  const auto whole = r.err.find("the whole base ", at);
  ASSERT_NE(whole, std::string::npos) << r;
  const double ratio = std::stod(r.err.substr(r.err.find('(', whole) + 1));
  EXPECT_LE(ratio, 0.3) << r;
  EXPECT_NE(r.err.find("x fp16; norms in float32)", whole), std::string::npos) << r;
  const auto l = losses("int4e"), p = losses("none");
  ASSERT_EQ(l.size(), 12u);
  ASSERT_EQ(p.size(), 12u);
  EXPECT_NEAR(l.front(), p.front(), 0.1);
  EXPECT_LT(l.back(), l.front() - 0.5);
  EXPECT_NEAR(l.back(), p.back(), 0.3);
  std::printf("[qlora int4 + embeddings] whole base %.3fx fp16; loss step 1 %.4f (unquantized %.4f), step 12 %.4f "
              "(unquantized %.4f)\n",
              ratio, l.front(), p.front(), l.back(), p.back());
  const std::string adapter = (dir_ / "int4e" / "final").string();
  auto model = replica::models::load_hf_model(demo_.model_dir);
  EXPECT_NO_THROW(replica::models::load_adapter(*model, adapter));
  const double over_quantized = eval_loss(adapter, {"--quantization", "int4", "--quantize-embeddings"});
  EXPECT_TRUE(std::isfinite(over_quantized));
  EXPECT_NEAR(over_quantized, eval_loss(adapter, {}), 0.3);
}

// Two workers (DDP; each quantizes the same base to the same codes) in bf16 mixed precision:
// the base held in bf16 before quantizing, computed under autocast, fp32 adapters.
TEST_F(QuantizedSft, TwoWorkersInBf16Train) {
  const Result r = train("bf16", {"--nproc-per-node", "2", "--quantization", "int4", "--mixed-precision", "bf16"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_NE(r.err.find("2 workers"), std::string::npos) << r;
  EXPECT_NE(r.err.find("embeddings, head and norms in bfloat16"), std::string::npos) << r;
  const auto l = losses("bf16");
  ASSERT_EQ(l.size(), 12u);
  for (double x : l) EXPECT_TRUE(std::isfinite(x));
  EXPECT_LT(l.back(), l.front() - 0.5);
  for (const auto& [name, t] :
       replica::testing::load_tensors(dir_ / "bf16" / "final" / "adapter_model.safetensors")) {
    EXPECT_EQ(t.scalar_type(), torch::kFloat32) << name;
  }
}

TEST_F(QuantizedSft, WhatCannotGoWithAQuantizedBaseIsRefusedBeforeAnyWorker) {
  auto refused = [&](const std::vector<std::string>& args) {
    std::vector<std::string> all = {"llm", "--train", "--model", demo_.model_dir, "--data-path", demo_.data_dir,
                                    "--project-name", (dir_ / "refused").string(), "--nproc-per-node", "2"};
    all.insert(all.end(), args.begin(), args.end());
    return replica(all);
  };
  const Result zero3 = refused({"--peft", "--quantization", "int4", "--distributed-backend", "zero3"});
  EXPECT_EQ(zero3.exit_code, 1) << zero3;
  EXPECT_NE(zero3.err.find("quantization int4 with distributed_backend zero3 (ZeRO stage 3) is not supported"),
            std::string::npos)
      << zero3;
  // deepspeed is AutoTrain's name for the same backend (zero_stage 3 goes only with it).
  const Result stage3 = refused({"--peft", "--quantization", "int8", "--distributed-backend", "deepspeed"});
  EXPECT_EQ(stage3.exit_code, 1) << stage3;
  EXPECT_NE(stage3.err.find("(ZeRO stage 3) is not supported"), std::string::npos) << stage3;
  const Result embeddings = refused({"--peft", "--quantize-embeddings"});
  EXPECT_EQ(embeddings.exit_code, 1) << embeddings;
  EXPECT_NE(embeddings.err.find("quantize_embeddings: true needs quantization int4 or int8"), std::string::npos)
      << embeddings;
  const Result typo = refused({"--peft", "--quantization", "nf3"});
  EXPECT_EQ(typo.exit_code, 1) << typo;
  EXPECT_NE(typo.err.find("quantization"), std::string::npos) << typo;
  EXPECT_NE(typo.err.find("int4"), std::string::npos) << typo;
  EXPECT_FALSE(fs::exists(dir_ / "refused"));
}
