// End-to-end tests of the trainer through the real `replica` program (REPLICA_BIN), run as
// child processes on Fashion-MNIST. Each test writes its YAML into a fresh temporary
// directory. Children are bounded: the runner waits on their pipes with poll() and a
// deadline, and kills the child's whole process group (and fails the test) when it
// overstays. Nothing here sleeps to synchronise.
#include "replica/core/error.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"
#include "replica/train/tests/tensor_files.h"
#include "replica/train/run_config.h"
#include "replica/tasks/image_classification/image_classification.h"
#include "replica/io/safetensors.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace fs = std::filesystem;

namespace {

using replica::testing::load_tensors;
using replica::testing::bitwise_equal;
using replica::testing::max_abs_diff;

using Clock = std::chrono::steady_clock;

constexpr const char* kFashionMnist = "/usr/share/datasets/fashion-mnist";

using replica::testing::Result;
using replica::testing::run_program;

Result replica(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {},
               std::chrono::seconds limit = std::chrono::seconds(60)) {
  return run_program(REPLICA_BIN, args, env, limit);
}

using replica::testing::read_file;

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") != std::string::npos) lines.push_back(line);
  }
  return lines;
}

// A TCP port nobody listens on right now.
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

std::vector<nlohmann::json> metrics_of(const fs::path& project) {
  std::vector<nlohmann::json> out;
  for (const auto& line : lines_of(read_file(project / "metrics.jsonl"))) {
    try {
      out.push_back(nlohmann::json::parse(line));
    } catch (const std::exception& e) {
      ADD_FAILURE() << "metrics.jsonl line is not JSON: '" << line << "': " << e.what();
    }
  }
  return out;
}

// Steps of the training lines (those with "loss"), in file order.
std::vector<int64_t> train_steps(const std::vector<nlohmann::json>& metrics) {
  std::vector<int64_t> steps;
  for (const auto& j : metrics) {
    if (j.contains("loss")) steps.push_back(j.at("step").get<int64_t>());
  }
  return steps;
}

std::vector<int64_t> one_to(int64_t n) {
  std::vector<int64_t> v;
  for (int64_t i = 1; i <= n; ++i) v.push_back(i);
  return v;
}

// Whether the output has an "error: ..." line containing every one of `parts`.
bool has_error_line(const std::string& text, const std::vector<std::string>& parts) {
  for (const auto& line : lines_of(text)) {
    if (line.find("error") == std::string::npos) continue;
    bool all = true;
    for (const auto& p : parts) all = all && line.find(p) != std::string::npos;
    if (all) return true;
  }
  return false;
}

class EndToEnd : public replica::testing::ScratchDirTest {
 protected:
  EndToEnd() : ScratchDirTest("replica-e2e") {}
  void SetUp() override {
    ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built (cmake --build builds it)";
    ASSERT_TRUE(fs::exists(fs::path(kFashionMnist) / "train-labels-idx1-ubyte.gz") ||
                fs::exists(fs::path(kFashionMnist) / "train-labels-idx1-ubyte"))
        << "Fashion-MNIST is not installed at " << kFashionMnist;
    ScratchDirTest::SetUp();
  }

  // The small SGD run every test starts from; `params` replaces or adds params: keys (YAML
  // text values), `top` adds raw top-level YAML.
  fs::path write_config(const std::string& name, const std::map<std::string, std::string>& params = {},
                        const std::string& data_path = kFashionMnist, const std::string& valid_split = "null",
                        const std::string& top = "") {
    std::map<std::string, std::string> p = {
        {"nproc_per_node", "1"},  {"max_steps", "20"},       {"batch_size", "32"},
        {"gradient_accumulation", "1"}, {"optimizer", "sgd"}, {"lr", "0.05"},
        {"momentum", "0.9"},      {"scheduler", "constant"}, {"warmup_steps", "0"},
        {"max_grad_norm", "0"},   {"shuffle", "true"},       {"seed", "7"},
        {"threads_per_worker", "1"}, {"checkpoint_every", "0"}, {"logging_steps", "1"},
        {"hidden_sizes", "[64]"},
    };
    for (const auto& [k, v] : params) p[k] = v;
    std::ostringstream y;
    y << "task: image-classification\n"
      << "backend: local\n"
      << "model: mlp\n"
      << "project_name: " << (dir_ / "project").string() << "\n"
      << "log: jsonl\n"
      << top << "data:\n"
      << "  path: " << data_path << "\n"
      << "  train_split: train\n"
      << "  valid_split: " << valid_split << "\n"
      << "params:\n";
    for (const auto& [k, v] : p) y << "  " << k << ": " << v << "\n";
    const fs::path file = dir_ / (name + ".yaml");
    std::ofstream(file) << y.str();
    return file;
  }

  // `replica --config FILE --project-name DIR extra...`, expected to succeed.
  Result train(const fs::path& config, const fs::path& project, const std::vector<std::string>& extra = {},
               const std::map<std::string, std::string>& env = {}) {
    std::vector<std::string> args = {"--config", config.string(), "--project-name", project.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    Result r = replica(args, env);
    EXPECT_EQ(r.exit_code, 0) << r;
    return r;
  }

  fs::path project(const std::string& name) const { return dir_ / name; }

};

// ---------------------------------------------------------------------------------------
// (a) Data parallelism is invisible in the result: 2 workers x B/2 == 1 worker x B.

TEST_F(EndToEnd, TwoWorkersWithHalfTheBatchMatchOneWorker) {
  const fs::path cfg = write_config("run");
  train(cfg, project("one"), {"--nproc-per-node", "1", "--batch-size", "32"});
  const Result two = train(cfg, project("two"), {"--nproc-per-node", "2", "--batch-size", "16"});
  if (HasFailure()) return;
  const auto a = load_tensors(project("one") / "final" / "model.safetensors");
  const auto b = load_tensors(project("two") / "final" / "model.safetensors");
  EXPECT_LE(max_abs_diff(a, b), 1e-5);
  // The second run really had two workers, and by default (shard_optimizer auto) two workers
  // on one host share one copy of the parameters and each steps half of it.
  EXPECT_NE(two.all().find("2 workers"), std::string::npos) << two;
  EXPECT_NE(two.all().find("backend ddp (sharded optimizer), parameters shared by the host's workers"),
            std::string::npos)
      << two;
  auto params = nlohmann::json::parse(read_file(project("two") / "training_params.json"));
  EXPECT_EQ(params.at("nproc_per_node"), 2);
  EXPECT_EQ(params.at("shard_optimizer"), "auto");
  EXPECT_EQ(train_steps(metrics_of(project("two"))), one_to(20));  // rank 0 alone writes metrics
}

// ---------------------------------------------------------------------------------------
// (b) Gradient accumulation (and DDP's no_sync on the micro-steps before the last).

TEST_F(EndToEnd, GradientAccumulationMatchesTheLargerBatch) {
  const fs::path cfg = write_config("run", {{"max_steps", "10"}});
  train(cfg, project("b32"), {"--batch-size", "32", "--gradient-accumulation", "1"});
  train(cfg, project("b8x4"), {"--batch-size", "8", "--gradient-accumulation", "4"});
  train(cfg, project("w2b8x2"), {"--nproc-per-node", "2", "--batch-size", "8", "--gradient-accumulation", "2"});
  if (HasFailure()) return;
  const auto ref = load_tensors(project("b32") / "final" / "model.safetensors");
  EXPECT_LE(max_abs_diff(ref, load_tensors(project("b8x4") / "final" / "model.safetensors")), 1e-5);
  EXPECT_LE(max_abs_diff(ref, load_tensors(project("w2b8x2") / "final" / "model.safetensors")), 1e-5);
  // 10 optimizer steps each, not 10 micro-steps.
  EXPECT_EQ(train_steps(metrics_of(project("b8x4"))), one_to(10));
  EXPECT_EQ(train_steps(metrics_of(project("w2b8x2"))), one_to(10));
}

// ---------------------------------------------------------------------------------------
// (c) The launcher fails fast when a worker fails.

TEST_F(EndToEnd, LaunchStopsTheGroupWhenOneRankFails) {
  const auto start = Clock::now();
  const Result r = replica({"launch", "--nproc-per-node", "2", "--", "sh", "-c",
                            "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60"},
                           {}, std::chrono::seconds(30));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_FALSE(r.timed_out);
  EXPECT_LT(seconds, 5.0) << r;
  EXPECT_NE(r.err.find("rank 1"), std::string::npos) << r;
  EXPECT_NE(r.err.find("code 3"), std::string::npos) << r;
}

// ---------------------------------------------------------------------------------------
// (d) Resume continues exactly where the checkpoint left off.

TEST_F(EndToEnd, ResumeContinuesBitForBit) {
  const fs::path cfg = write_config("run", {{"checkpoint_every", "10"}});
  train(cfg, project("a"), {"--max-steps", "20"});

  const fs::path b = project("b");
  train(cfg, b, {"--max-steps", "10"});
  if (HasFailure()) return;
  ASSERT_TRUE(fs::is_directory(b / "checkpoint-10"));
  ASSERT_EQ(train_steps(metrics_of(b)), one_to(10));
  // What a run killed after step 12 (before its next checkpoint) would have left behind:
  // metrics of steps that the resumed run redoes, and a torn last line.
  {
    std::ofstream m(b / "metrics.jsonl", std::ios::app);
    m << R"({"step": 11, "epoch": 0.01, "loss": 9.0, "lr": 0.05, "samples_per_s": 1.0})" << "\n"
      << R"({"step": 12, "epoch": 0.01, "loss": 9.0, "lr": 0.05, "samples_per_s": 1.0})" << "\n"
      << R"({"step": 13, "epo)";
  }
  const Result resumed = train(cfg, b, {"--max-steps", "20"});
  if (HasFailure()) return;
  EXPECT_NE(resumed.all().find("resuming from"), std::string::npos) << resumed;
  EXPECT_NE(resumed.all().find("checkpoint-10"), std::string::npos) << resumed;

  const auto fa = load_tensors(project("a") / "final" / "model.safetensors");
  const auto fb = load_tensors(b / "final" / "model.safetensors");
  EXPECT_TRUE(bitwise_equal(fa, fb)) << "max abs diff " << max_abs_diff(fa, fb);
  // The checkpoints at step 20 agree too (model and optimizer state).
  EXPECT_TRUE(bitwise_equal(load_tensors(project("a") / "checkpoint-20" / "optimizer.safetensors"),
                            load_tensors(b / "checkpoint-20" / "optimizer.safetensors")));

  // Every step exactly once, in order, with none of the stale lines.
  const auto metrics = metrics_of(b);
  EXPECT_EQ(train_steps(metrics), one_to(20));
  for (const auto& j : metrics) {
    if (j.contains("loss")) EXPECT_LT(j.at("loss").get<double>(), 9.0) << j.dump();
  }
  // The losses of the resumed run equal those of the straight run (same data, same weights).
  const auto ma = metrics_of(project("a"));
  ASSERT_EQ(ma.size(), metrics.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i].at("step"), metrics[i].at("step"));
    EXPECT_DOUBLE_EQ(ma[i].at("loss").get<double>(), metrics[i].at("loss").get<double>()) << "line " << i;
  }
}

// A checkpoint written by one world size, resumed by another with the same global batch
// (2 workers x 16 instead of 1 x 32): the run continues from the same place in the data
// (trainer.cpp: "the position in the epoch is kept as a count of global samples, so a
// different world continues from the same place") and ends where the straight run ends.
TEST_F(EndToEnd, ResumeOnAnotherWorldSizeContinuesAtTheSameSample) {
  const fs::path cfg = write_config("run", {{"checkpoint_every", "10"}});
  train(cfg, project("a"), {"--max-steps", "20"});
  const fs::path b = project("b");
  train(cfg, b, {"--max-steps", "10"});
  const Result resumed = train(cfg, b, {"--max-steps", "20", "--nproc-per-node", "2", "--batch-size", "16"});
  if (HasFailure()) return;
  EXPECT_NE(resumed.all().find("resuming from"), std::string::npos) << resumed;
  auto state = nlohmann::json::parse(read_file(b / "checkpoint-20" / "trainer_state.json"));
  EXPECT_EQ(state.at("global_step"), 20);
  EXPECT_EQ(state.at("world_size"), 2);
  EXPECT_LE(max_abs_diff(load_tensors(project("a") / "final" / "model.safetensors"),
                         load_tensors(b / "final" / "model.safetensors")),
            1e-5)
      << "the resumed run trained on other samples than the straight run";
}

// A project whose first attempt died before its first checkpoint holds only config.yaml,
// training_params.json and a partial metrics.jsonl: a fresh start (--overwrite, or the
// launcher's restart of the same run) must not keep the dead attempt's lines in its
// metrics.jsonl (each step exactly once).
TEST_F(EndToEnd, FreshStartDoesNotKeepStaleMetrics) {
  const fs::path cfg = write_config("run", {{"max_steps", "5"}});
  const fs::path p = project("p");
  fs::create_directories(p);
  {
    std::ofstream m(p / "metrics.jsonl");
    for (int s = 1; s <= 3; ++s) {
      m << nlohmann::json{{"step", s}, {"epoch", 0.0}, {"loss", 9.0}, {"lr", 0.05}, {"samples_per_s", 1.0}}.dump()
        << "\n";
    }
  }
  // Without --overwrite these metrics are refused, not replaced
  // (EarlierOutputsWithoutACheckpointAreAnErrorAndOverwriteKeepsTheUsersFiles).
  train(cfg, p, {"--overwrite"});
  if (HasFailure()) return;
  EXPECT_EQ(train_steps(metrics_of(p)), one_to(5));
}

// A corrupt newest checkpoint (one byte changed) is skipped with a warning naming it; the run resumes from the
// previous one and ends where the straight run ends.
TEST_F(EndToEnd, CorruptNewestCheckpointIsSkipped) {
  const fs::path cfg = write_config("run", {{"checkpoint_every", "10"}, {"save_total_limit", "2"}});
  const fs::path p = project("p");
  train(cfg, p, {"--max-steps", "20"});
  if (HasFailure()) return;
  ASSERT_TRUE(fs::is_directory(p / "checkpoint-10"));
  ASSERT_TRUE(fs::is_directory(p / "checkpoint-20"));
  const auto straight = load_tensors(p / "final" / "model.safetensors");
  // One flipped byte in the weights: the file still parses, only its checksum tells.
  const fs::path model = p / "checkpoint-20" / "model.safetensors";
  {
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-100, std::ios::end);
    const char c = static_cast<char>(f.get() ^ 0x10);
    f.seekp(-100, std::ios::end);
    f.put(c);
  }

  const Result r = train(cfg, p, {"--max-steps", "20"});
  if (HasFailure()) return;
  bool warned = false;
  for (const auto& line : lines_of(r.all())) {
    warned = warned || (line.find("skipping") != std::string::npos && line.find("checkpoint-20") != std::string::npos);
  }
  EXPECT_TRUE(warned) << r;
  EXPECT_NE(r.all().find("resuming from " + (p / "checkpoint-10").string()), std::string::npos) << r;
  EXPECT_TRUE(bitwise_equal(straight, load_tensors(p / "final" / "model.safetensors")));
  EXPECT_EQ(train_steps(metrics_of(p)), one_to(20));
}

// ---------------------------------------------------------------------------------------
// (e) Bad inputs: one clear line on stderr, a non-zero exit, no hang.

// A config error found before any worker starts: exactly one line, "error: ...".
void expect_single_error_line(const Result& r, const std::vector<std::string>& parts) {
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_FALSE(r.timed_out);
  const auto lines = lines_of(r.err);
  ASSERT_EQ(lines.size(), 1u) << r;
  EXPECT_EQ(lines[0].rfind("error: ", 0), 0u) << r;
  for (const auto& p : parts) EXPECT_NE(lines[0].find(p), std::string::npos) << "missing '" << p << "'\n" << r;
}

TEST_F(EndToEnd, UnknownKeyIsAnErrorWithASuggestion) {
  const fs::path cfg = write_config("run", {{"bach_size", "32"}});
  const Result r = replica({"--config", cfg.string()});
  expect_single_error_line(r, {"bach_size", "did you mean", "batch_size", cfg.string()});
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_FALSE(fs::exists(dir_ / "project")) << "nothing may be written for a bad config";

  // The same through a command-line override: the flag as typed and the nearest valid one.
  const fs::path good = write_config("good");
  const Result f = replica({"--config", good.string(), "--lrr", "0.1"});
  expect_single_error_line(f, {"unknown flag --lrr", "did you mean --lr?"});
  const Result g = replica({"--config", good.string(), "--lerning-rate", "0.1"});
  expect_single_error_line(g, {"unknown flag --lerning-rate", "did you mean --lr?"});
}

// A command line CLI11 cannot parse exits 1, as every other error does (CLI11's own code for
// an unknown flag is 105), naming the flag as typed; --help still exits 0.
TEST_F(EndToEnd, CommandLineParseErrorsExitOneNamingTheFlag) {
  const Result r = replica({"launch", "--nproc-per-nod", "2", "--", "true"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_NE((r.out + r.err).find("--nproc-per-nod"), std::string::npos) << r;
  const Result help = replica({"--help"});
  EXPECT_EQ(help.exit_code, 0) << help;
}

// --train-split / --valid-split after --config reach data: as `replica llm`'s flags do.
TEST_F(EndToEnd, SplitFlagsAfterConfigGoToTheDataSection) {
  const fs::path cfg = write_config("run", {}, kFashionMnist, "null");
  const fs::path p = project("splits");
  const Result r = replica({"--config", cfg.string(), "--project-name", p.string(), "--valid-split", "t10k",
                            "--max-steps", "2"});
  ASSERT_EQ(r.exit_code, 0) << r;
  const auto resolved = replica::train::parse_config(read_file(p / "config.yaml"), (p / "config.yaml").string());
  ASSERT_TRUE(resolved.data.valid_split.has_value());
  EXPECT_EQ(*resolved.data.valid_split, "t10k");
  EXPECT_EQ(resolved.data.train_split, "train");
}

TEST_F(EndToEnd, WrongTypeIsAnErrorNamingTheKey) {
  const fs::path cfg = write_config("run", {{"batch_size", "lots"}});
  const Result r = replica({"--config", cfg.string()});
  expect_single_error_line(r, {"batch_size", "integer", "lots", cfg.string()});

  const fs::path good = write_config("good");
  const Result f = replica({"--config", good.string(), "--max-steps", "twenty"});
  expect_single_error_line(f, {"max_steps", "twenty"});
}

TEST_F(EndToEnd, MissingDataDirectoryIsAnErrorNamingIt) {
  const std::string missing = (dir_ / "no-such-data").string();
  const fs::path cfg = write_config("run", {}, missing);
  const Result r = replica({"--config", cfg.string()});
  expect_single_error_line(r, {"data.path", missing, "does not exist"});
  EXPECT_FALSE(fs::exists(dir_ / "project"));
}

TEST_F(EndToEnd, CorruptOnlyCheckpointIsAnErrorNamingIt) {
  const fs::path cfg = write_config("run", {{"checkpoint_every", "10"}, {"max_steps", "10"}});
  const fs::path p = project("p");
  train(cfg, p);
  if (HasFailure()) return;
  const fs::path model = p / "checkpoint-10" / "model.safetensors";
  ASSERT_TRUE(fs::exists(model));
  fs::resize_file(model, fs::file_size(model) / 3);

  const Result r = replica({"--config", cfg.string(), "--project-name", p.string(), "--max-steps", "20"});
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_TRUE(has_error_line(r.err, {(p / "checkpoint-10").string(), "no usable checkpoint"})) << r;
  EXPECT_NE(r.err.find("--overwrite"), std::string::npos) << r;
  // Nothing was trained over the corrupt project.
  EXPECT_FALSE(fs::exists(p / "checkpoint-20"));
  EXPECT_EQ(train_steps(metrics_of(p)), one_to(10));

  // --overwrite starts afresh.
  const Result fresh = replica({"--config", cfg.string(), "--project-name", p.string(), "--max-steps", "5",
                                "--checkpoint-every", "0", "--overwrite"});
  EXPECT_EQ(fresh.exit_code, 0) << fresh;
  EXPECT_FALSE(fs::exists(p / "checkpoint-10"));
  EXPECT_EQ(train_steps(metrics_of(p)), one_to(5));
}

// An earlier run's outputs with no checkpoint (a run that crashed before its first one) are
// not silently replaced; --overwrite removes them and nothing else of the directory.
TEST_F(EndToEnd, EarlierOutputsWithoutACheckpointAreAnErrorAndOverwriteKeepsTheUsersFiles) {
  const fs::path cfg = write_config("run", {{"max_steps", "5"}});
  const fs::path p = project("p");
  train(cfg, p);
  if (HasFailure()) return;
  // As a crashed run leaves it: no final/, an error record; and the user's own files.
  fs::remove_all(p / "final");
  fs::create_directories(p / "errors");
  std::ofstream(p / "errors" / "rank-1.restart-0.json") << "{\"message\": \"crashed\"}\n";
  std::ofstream(p / "notes.txt") << "my notes\n";
  fs::create_directories(p / "my-data");
  std::ofstream(p / "my-data" / "train.jsonl") << "{}\n";
  const std::string metrics_before = read_file(p / "metrics.jsonl");

  const Result again = replica({"--config", cfg.string(), "--project-name", p.string(), "--max-steps", "3"});
  EXPECT_NE(again.exit_code, 0) << again;
  EXPECT_TRUE(has_error_line(again.err, {p.string(), "config.yaml", "errors/", "metrics.jsonl",
                                         "training_params.json", "no checkpoint", "--overwrite"}))
      << again;
  EXPECT_EQ(read_file(p / "metrics.jsonl"), metrics_before);  // nothing replaced
  EXPECT_TRUE(fs::exists(p / "errors" / "rank-1.restart-0.json"));

  const Result fresh = replica({"--config", cfg.string(), "--project-name", p.string(), "--max-steps", "3",
                                "--overwrite"});
  EXPECT_EQ(fresh.exit_code, 0) << fresh;
  EXPECT_EQ(train_steps(metrics_of(p)), one_to(3));
  EXPECT_FALSE(fs::exists(p / "errors"));
  EXPECT_EQ(read_file(p / "notes.txt"), "my notes\n");
  EXPECT_EQ(read_file(p / "my-data" / "train.jsonl"), "{}\n");
  EXPECT_TRUE(fs::exists(p / "final" / "model.safetensors"));

  // errors/ alone (a run that failed before writing anything else) does not block a new run.
  const fs::path q = project("q");
  fs::create_directories(q / "errors");
  std::ofstream(q / "errors" / "rank-0.restart-0.json") << "{\"message\": \"port busy\"}\n";
  const Result after_failure = replica({"--config", cfg.string(), "--project-name", q.string(), "--max-steps", "2"});
  EXPECT_EQ(after_failure.exit_code, 0) << after_failure;
}

// `replica launch -- replica --config ...` with a failing worker: the failure is recorded in
// the project's errors/ and the error file the launcher printed still exists afterwards.
TEST_F(EndToEnd, LaunchedRunKeepsItsErrorFileInTheProjectAndThePrintedOne) {
  // Data that exists but is not Fashion-MNIST: the workers start and fail loading it.
  fs::create_directories(dir_ / "empty-data");
  const fs::path cfg = write_config("run", {{"max_steps", "5"}}, (dir_ / "empty-data").string());
  const fs::path p = project("p");
  const Result r = replica({"launch", "--nproc-per-node", "2", "--", REPLICA_BIN, "--config", cfg.string(),
                            "--project-name", p.string()});
  EXPECT_NE(r.exit_code, 0) << r;
  // The first rank to fail wrote its record (the launcher then stops the other).
  int records = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(p / "errors", ec)) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(name == "rank-0.restart-0.json" || name == "rank-1.restart-0.json") << name;
    const auto record = nlohmann::json::parse(read_file(entry.path()));
    EXPECT_NE(record.at("message").get<std::string>().find("empty-data"), std::string::npos) << record.dump();
    ++records;
  }
  EXPECT_GE(records, 1) << r;
  // The workers' error lines are whole lines naming their rank (written in one piece each,
  // so two ranks failing at once never interleave mid-line).
  int worker_errors = 0;
  for (const auto& line : lines_of(r.err)) {
    if (line.find("error:") == std::string::npos) continue;
    ++worker_errors;
    EXPECT_EQ(line.rfind("error: rank ", 0), 0u) << line;
    EXPECT_EQ(line.find("error:", 1), std::string::npos) << "two error lines in one: " << line;
  }
  EXPECT_GE(worker_errors, 1) << r;
  // Every error file path the launcher printed can still be opened.
  const std::regex printed("(/[^ ]*replica-launch-[^ ]*\\.json)");
  int paths = 0;
  for (const auto& line : lines_of(r.err)) {
    std::smatch m;
    if (!std::regex_search(line, m, printed)) continue;
    ++paths;
    EXPECT_TRUE(fs::exists(m[1].str())) << line;
    fs::remove_all(fs::path(m[1].str()).parent_path());
  }
  EXPECT_GE(paths, 1) << r;
}

TEST_F(EndToEnd, BusyRendezvousPortIsAnError) {
  // Hold a listening socket on a port, then ask for it.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);

  const fs::path cfg = write_config("run");
  const Result r = replica({"--config", cfg.string(), "--nproc-per-node", "2", "--master-port", std::to_string(port)},
                           {}, std::chrono::seconds(60));
  close(fd);
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_TRUE(has_error_line(r.err, {"already in use", std::to_string(port)})) << r;
  EXPECT_LT(r.seconds, 20.0) << r;
  EXPECT_FALSE(fs::exists(dir_ / "project" / "final"));
}

TEST_F(EndToEnd, RankThatNeverStartsIsNamed) {
  const fs::path cfg = write_config("run");
  const int port = free_port();
  const std::map<std::string, std::string> env = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}};
  const Result r = replica({"--config", cfg.string(), "--rdzv-timeout", "2"}, env, std::chrono::seconds(60));
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_TRUE(has_error_line(r.err, {"rank 1 never joined"})) << r;
  EXPECT_LT(r.seconds, 10.0) << r;
}

// PRODUCT.md: "rdzv_timeout seconds (--rdzv-timeout, env REPLICA_RDZV_TIMEOUT), default 300".
TEST_F(EndToEnd, RendezvousTimeoutFromTheEnvironment) {
  const fs::path cfg = write_config("run");
  const int port = free_port();
  const std::map<std::string, std::string> env = {{"RANK", "0"},
                                                  {"WORLD_SIZE", "2"},
                                                  {"MASTER_ADDR", "127.0.0.1"},
                                                  {"MASTER_PORT", std::to_string(port)},
                                                  {"REPLICA_RDZV_TIMEOUT", "2"}};
  const Result r = replica({"--config", cfg.string()}, env, std::chrono::seconds(20));
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_TRUE(has_error_line(r.err, {"rank 1 never joined"})) << r;
  EXPECT_LT(r.seconds, 10.0) << r;
}

// ---------------------------------------------------------------------------------------
// (f) What a run leaves in project_name/.

TEST_F(EndToEnd, RunLeavesTheDocumentedArtifacts) {
  const std::string secret = "s3cr3t-rdzv-token-9f1c";
  const fs::path cfg = write_config("run",
                                    {{"checkpoint_every", "10"},
                                     {"save_total_limit", "2"},
                                     {"eval_every", "10"},
                                     {"token", secret}},
                                    kFashionMnist, "t10k");
  const fs::path p = project("p");
  const Result r = train(cfg, p);
  if (HasFailure()) return;
  EXPECT_EQ(r.all().find(secret), std::string::npos) << "the token was logged";

  // config.yaml: the resolved configuration, readable back as the same run.
  ASSERT_TRUE(fs::is_regular_file(p / "config.yaml"));
  const std::string config_text = read_file(p / "config.yaml");
  const auto resolved = replica::train::parse_config(config_text, (p / "config.yaml").string());
  EXPECT_EQ(resolved.params.max_steps, 20);
  EXPECT_EQ(resolved.params.batch_size, 32);
  EXPECT_EQ(resolved.params.optimizer, replica::train::OptimizerKind::Sgd);
  EXPECT_EQ(resolved.params.checkpoint_every, 10);
  EXPECT_EQ(image_params(resolved).hidden_sizes, (std::vector<int64_t>{64}));
  EXPECT_EQ(resolved.project_name, p.string());
  ASSERT_TRUE(resolved.data.valid_split.has_value());
  EXPECT_EQ(*resolved.data.valid_split, "t10k");
  // Every default is written out.
  for (const char* key : {"rdzv_timeout", "collective_timeout", "weight_decay", "warmup_ratio", "deterministic"}) {
    EXPECT_NE(config_text.find(key), std::string::npos) << key;
  }

  // training_params.json.
  const auto params = nlohmann::json::parse(read_file(p / "training_params.json"));
  EXPECT_EQ(params.at("max_steps"), 20);
  EXPECT_EQ(params.at("batch_size"), 32);
  EXPECT_EQ(params.at("optimizer"), "sgd");
  EXPECT_EQ(params.at("task"), "image-classification");
  EXPECT_FALSE(params.contains("token"));

  // metrics.jsonl: training lines and evaluations.
  const auto metrics = metrics_of(p);
  EXPECT_EQ(train_steps(metrics), one_to(20));
  std::vector<int64_t> eval_steps;
  for (const auto& j : metrics) {
    if (j.contains("loss")) {
      for (const char* k : {"step", "epoch", "loss", "lr", "samples_per_s"}) EXPECT_TRUE(j.contains(k)) << k << " in " << j;
      EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
      EXPECT_GT(j.at("loss").get<double>(), 0.0);
      EXPECT_DOUBLE_EQ(j.at("lr").get<double>(), 0.05);
      EXPECT_GT(j.at("samples_per_s").get<double>(), 0.0);
    }
    if (j.contains("eval_loss")) {
      eval_steps.push_back(j.at("step").get<int64_t>());
      ASSERT_TRUE(j.contains("eval_accuracy")) << j;
      const double acc = j.at("eval_accuracy").get<double>();
      EXPECT_GE(acc, 0.0);
      EXPECT_LE(acc, 1.0);
      EXPECT_TRUE(std::isfinite(j.at("eval_loss").get<double>()));
    }
  }
  EXPECT_EQ(eval_steps, (std::vector<int64_t>{10, 20}));
  // A mid-epoch evaluation logs the same fractional epoch as the training line of its step.
  std::map<int64_t, double> train_epoch;
  for (const auto& j : metrics) {
    if (j.contains("loss")) train_epoch[j.at("step").get<int64_t>()] = j.at("epoch").get<double>();
  }
  for (const auto& j : metrics) {
    if (!j.contains("eval_loss")) continue;
    const int64_t step = j.at("step").get<int64_t>();
    ASSERT_TRUE(train_epoch.count(step)) << j;
    EXPECT_GT(train_epoch[step], 0.0);
    EXPECT_DOUBLE_EQ(j.at("epoch").get<double>(), train_epoch[step]) << j;
  }
  // 20 SGD steps on Fashion-MNIST beat chance (10%) comfortably.
  for (const auto& j : metrics) {
    if (j.contains("eval_accuracy") && j.at("step") == 20) EXPECT_GT(j.at("eval_accuracy").get<double>(), 0.3) << j;
  }

  // checkpoint-N/.
  for (int step : {10, 20}) {
    const fs::path c = p / ("checkpoint-" + std::to_string(step));
    for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"}) {
      EXPECT_TRUE(fs::is_regular_file(c / f)) << c / f;
    }
    const auto state = nlohmann::json::parse(read_file(c / "trainer_state.json"));
    EXPECT_EQ(state.at("global_step"), step);
    EXPECT_EQ(state.at("world_size"), 1);
    EXPECT_EQ(state.at("micro_step"), step);
    EXPECT_FALSE(replica::io::load_safetensors((c / "optimizer.safetensors").string()).tensors.empty());
  }

  // final/.
  const auto final_model = load_tensors(p / "final" / "model.safetensors");
  ASSERT_EQ(final_model.count("layers.0.weight"), 1u);
  EXPECT_EQ(final_model.at("layers.0.weight").sizes(), (std::vector<int64_t>{64, 784}));
  EXPECT_EQ(final_model.at("layers.2.weight").sizes(), (std::vector<int64_t>{10, 64}));
  EXPECT_TRUE(bitwise_equal(final_model, load_tensors(p / "checkpoint-20" / "model.safetensors")));
  const auto model_config = nlohmann::json::parse(read_file(p / "final" / "config.json"));
  EXPECT_EQ(model_config.at("model_type"), "mlp");
  EXPECT_EQ(model_config.at("num_classes"), 10);

  // No temporary files left, and the token is in no file of the project.
  for (const auto& e : fs::recursive_directory_iterator(p)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
    if (e.is_regular_file()) EXPECT_EQ(read_file(e.path()).find(secret), std::string::npos) << e.path();
  }
}

// ---------------------------------------------------------------------------------------
// DDP with shard_optimizer: each worker steps 1/N of the parameters, and the result is plain
// DDP's. World 3 cuts the 125,600-element first layer and the buckets unevenly.

// The largest "N MiB optimizer" any worker logged at the end of a run.
double optimizer_mib(const Result& r) {
  static const std::regex line(R"(([0-9.]+) MiB optimizer)");
  double most = -1;
  const std::string text = r.all();
  for (auto it = std::sregex_iterator(text.begin(), text.end(), line); it != std::sregex_iterator(); ++it) {
    most = std::max(most, std::stod((*it)[1].str()));
  }
  return most;
}

TEST_F(EndToEnd, ShardedOptimizerEqualsDdp) {
  for (const std::string optimizer : {"sgd", "adamw"}) {
    std::map<std::string, std::string> params = {
        {"hidden_sizes", "[160, 32]"}, {"optimizer", optimizer}, {"lr", optimizer == "sgd" ? "0.05" : "0.002"},
        {"max_grad_norm", "1.0"},      {"gradient_accumulation", "2"}, {"max_steps", "12"},
        {"shard_optimizer", "false"}};
    const fs::path plain = write_config("plain-" + optimizer, params);
    params["shard_optimizer"] = "true";
    const fs::path sharded = write_config("sharded-" + optimizer, params);
    for (const std::string world : {"2", "3"}) {
      const std::string tag = optimizer + "-w" + world;
      const Result plain_run = train(plain, project("ddp-" + tag), {"--nproc-per-node", world, "--batch-size", "8"});
      const Result r = train(sharded, project("sharded-" + tag), {"--nproc-per-node", world, "--batch-size", "8"});
      if (HasFailure()) return;
      const auto a = load_tensors(project("ddp-" + tag) / "final" / "model.safetensors");
      const auto b = load_tensors(project("sharded-" + tag) / "final" / "model.safetensors");
      EXPECT_LE(max_abs_diff(a, b), 1e-6) << tag;
      // The logged gradient norms (a global norm over the shards) agree too.
      const auto ma = metrics_of(project("ddp-" + tag)), mb = metrics_of(project("sharded-" + tag));
      ASSERT_EQ(ma.size(), mb.size()) << tag;
      for (size_t i = 0; i < ma.size(); ++i) {
        EXPECT_NEAR(ma[i].at("grad_norm").get<double>(), mb[i].at("grad_norm").get<double>(), 1e-5) << tag << " line " << i;
      }
      // Each worker holds 1/N of the optimizer state.
      EXPECT_NE(r.all().find("backend ddp (sharded optimizer)"), std::string::npos) << r;
      // On one host the workers share one copy of the parameters (a barrier, no all-gather).
      EXPECT_NE(r.all().find("parameters shared by the host's workers"), std::string::npos) << r;
      EXPECT_LT(optimizer_mib(r), optimizer_mib(plain_run) * 0.7) << r << plain_run;  // 0.1 MiB rounding
    }
  }
}

// Checkpoints of a sharded run hold the full optimizer state (what plain DDP writes), so they
// resume bit for bit sharded, and on one worker without sharding.
TEST_F(EndToEnd, ShardedOptimizerCheckpointsResumeOnAnyWorldSize) {
  std::map<std::string, std::string> params = {{"hidden_sizes", "[160]"}, {"optimizer", "adamw"}, {"lr", "0.002"},
                                               {"checkpoint_every", "10"}, {"deterministic", "true"},
                                               {"shard_optimizer", "false"}};
  const fs::path plain = write_config("plain", params);
  params["shard_optimizer"] = "true";
  const fs::path sharded = write_config("sharded", params);
  const std::vector<std::string> two = {"--nproc-per-node", "2", "--batch-size", "16"};
  auto with_steps = [&](const char* steps) {
    auto args = two;
    args.insert(args.end(), {"--max-steps", steps});
    return args;
  };
  train(sharded, project("straight"), with_steps("20"));
  train(plain, project("plain"), with_steps("10"));
  const fs::path b = project("b");
  train(sharded, b, with_steps("10"));
  if (HasFailure()) return;
  // The same full state as plain DDP's checkpoint.
  const auto state_plain = load_tensors(project("plain") / "checkpoint-10" / "optimizer.safetensors");
  const auto state_sharded = load_tensors(b / "checkpoint-10" / "optimizer.safetensors");
  ASSERT_EQ(state_plain.size(), state_sharded.size());
  for (const auto& [name, t] : state_plain) {
    ASSERT_TRUE(state_sharded.count(name)) << name;
    EXPECT_EQ(t.sizes(), state_sharded.at(name).sizes()) << name;
  }
  EXPECT_LE(max_abs_diff(state_plain, state_sharded), 1e-6);
  // Copy the checkpoint before resuming sharded; the copy resumes on one plain worker.
  const fs::path c = project("c");
  fs::create_directories(c);
  fs::copy(b / "checkpoint-10", c / "checkpoint-10", fs::copy_options::recursive);
  const Result resumed = train(sharded, b, with_steps("20"));
  train(plain, c, {"--nproc-per-node", "1", "--batch-size", "32", "--max-steps", "20"});
  if (HasFailure()) return;
  EXPECT_NE(resumed.all().find("resuming from"), std::string::npos) << resumed;
  const auto straight = load_tensors(project("straight") / "final" / "model.safetensors");
  EXPECT_TRUE(bitwise_equal(straight, load_tensors(b / "final" / "model.safetensors")))
      << "max abs diff " << max_abs_diff(straight, load_tensors(b / "final" / "model.safetensors"));
  EXPECT_LE(max_abs_diff(straight, load_tensors(c / "final" / "model.safetensors")), 1e-5);
}

// AutoTrain's other optimizers through the program at world 2, each resumed from a checkpoint
// bit for bit: paged_adamw_8bit (on the CPU DDP shards the step by default: 8-bit state per
// shard, gathered per element into the checkpoint), adamw_bnb_8bit under ZeRO-3 (shard
// checkpoints), and adafactor (whole parameters: DDP does not shard its step).
TEST_F(EndToEnd, EightBitAdamWAndAdafactorResumeBitForBitAtWorldTwo) {
  struct Variant {
    std::string optimizer, backend, engine_line;
  };
  for (const Variant& v : {Variant{"paged_adamw_8bit", "ddp", "backend ddp (sharded optimizer)"},
                           Variant{"adamw_bnb_8bit", "deepspeed", "backend zero3"},
                           Variant{"adafactor", "ddp", "backend ddp,"}}) {
    SCOPED_TRACE(v.optimizer + " " + v.backend);
    // hidden_sizes [160]: a 125,600-element first layer (8-bit state, 491 blocks a worker) and
    // small ones (float32 state under 4096 elements).
    const fs::path cfg = write_config(v.optimizer + "-" + v.backend,
                                      {{"hidden_sizes", "[160]"}, {"optimizer", v.optimizer}, {"lr", "0.002"},
                                       // A schedule that does not depend on max_steps (the runs differ in it).
                                       {"scheduler", "constant_with_warmup"}, {"warmup_steps", "2"},
                                       {"checkpoint_every", "5"}, {"save_total_limit", "2"}, {"deterministic", "true"},
                                       {"distributed_backend", v.backend}});
    auto args = [](const char* steps) {
      return std::vector<std::string>{"--nproc-per-node", "2", "--batch-size", "16", "--max-steps", steps};
    };
    const fs::path a = project("straight-" + v.optimizer), b = project("resumed-" + v.optimizer);
    const Result straight = train(cfg, a, args("10"));
    train(cfg, b, args("5"));
    const Result resumed = train(cfg, b, args("10"));
    if (HasFailure()) return;
    EXPECT_NE(straight.all().find(v.engine_line), std::string::npos) << straight;
    EXPECT_NE(resumed.all().find("resuming from"), std::string::npos) << resumed;
    const auto fa = load_tensors(a / "final" / "model.safetensors");
    const auto fb = load_tensors(b / "final" / "model.safetensors");
    EXPECT_TRUE(bitwise_equal(fa, fb)) << "max abs diff " << max_abs_diff(fa, fb);
    if (v.backend == "ddp") {
      EXPECT_GT(max_abs_diff(fa, load_tensors(b / "checkpoint-5" / "model.safetensors")), 0.0);  // it trained
      EXPECT_TRUE(bitwise_equal(load_tensors(a / "checkpoint-10" / "optimizer.safetensors"),
                                load_tensors(b / "checkpoint-10" / "optimizer.safetensors")));
    } else {
      // ZeRO-3's shard files: master weights and 8-bit state of each worker.
      for (const char* rank : {"rank-0.safetensors", "rank-1.safetensors"}) {
        EXPECT_TRUE(bitwise_equal(load_tensors(a / "checkpoint-10" / "zero" / rank),
                                  load_tensors(b / "checkpoint-10" / "zero" / rank)))
            << rank;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// ZeRO-3 (distributed_backend zero3 / deepspeed): the same run as DDP; shard checkpoints that
// resume at another world size and consolidate into what DDP saves. hidden_sizes [160] makes
// the first layer (125,600 elements) larger than stage3_param_persistence_threshold (1e5), so
// it is gathered and freed around its forward and backward.

TEST_F(EndToEnd, Zero3World2EqualsDdpWorld2) {
  const fs::path cfg = write_config("run", {{"hidden_sizes", "[160]"}, {"optimizer", "adamw"}, {"lr", "0.001"},
                                            {"max_grad_norm", "1.0"}, {"gradient_accumulation", "2"}});
  train(cfg, project("ddp"), {"--nproc-per-node", "2", "--batch-size", "8"});
  const Result z = train(cfg, project("zero"), {"--nproc-per-node", "2", "--batch-size", "8",
                                                "--distributed-backend", "deepspeed"});
  if (HasFailure()) return;
  EXPECT_LE(max_abs_diff(load_tensors(project("ddp") / "final" / "model.safetensors"),
                         load_tensors(project("zero") / "final" / "model.safetensors")),
            1e-5);
  EXPECT_NE(z.all().find("backend zero3"), std::string::npos) << z;
  EXPECT_NE(z.all().find("per-worker model state"), std::string::npos) << z;
}

TEST_F(EndToEnd, Zero3ResumesOnOneWorkerAndConsolidates) {
  const fs::path cfg = write_config("run", {{"hidden_sizes", "[160]"}, {"checkpoint_every", "10"},
                                            {"distributed_backend", "zero3"}});
  train(cfg, project("a"), {"--max-steps", "20", "--nproc-per-node", "2", "--batch-size", "16"});
  const fs::path b = project("b");
  train(cfg, b, {"--max-steps", "10", "--nproc-per-node", "2", "--batch-size", "16"});
  if (HasFailure()) return;
  const fs::path c10 = b / "checkpoint-10";
  for (const char* f : {"zero/metadata.json", "zero/rank-0.safetensors", "zero/rank-1.safetensors",
                        "trainer_state.json"}) {
    EXPECT_TRUE(fs::is_regular_file(c10 / f)) << c10 / f;
  }
  // 2 -> 1 worker with the same global batch: the shards are re-cut on load.
  const Result resumed = train(cfg, b, {"--max-steps", "20", "--nproc-per-node", "1", "--batch-size", "32"});
  if (HasFailure()) return;
  EXPECT_NE(resumed.all().find("resuming from"), std::string::npos) << resumed;
  const auto fa = load_tensors(project("a") / "final" / "model.safetensors");
  const auto fb = load_tensors(b / "final" / "model.safetensors");
  EXPECT_LE(max_abs_diff(fa, fb), 1e-5);
  // The loss curve continues: every step once, and the resumed steps' losses are the
  // straight run's.
  const auto ma = metrics_of(project("a")), mb = metrics_of(b);
  EXPECT_EQ(train_steps(mb), one_to(20));
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_NEAR(ma[i].at("loss").get<double>(), mb[i].at("loss").get<double>(), 1e-5) << "line " << i;
  }
  // replica consolidate: the full model, as DDP saves it.
  const fs::path out = dir_ / "consolidated.safetensors";
  const Result cons = replica({"consolidate", (b / "checkpoint-20").string(), out.string()});
  EXPECT_EQ(cons.exit_code, 0) << cons;
  const auto consolidated = load_tensors(out);
  EXPECT_EQ(consolidated.size(), fb.size());
  EXPECT_TRUE(bitwise_equal(consolidated, fb));
  const Result bad = replica({"consolidate", project("a").string(), out.string()});
  EXPECT_EQ(bad.exit_code, 1) << bad;
  EXPECT_NE(bad.err.find("not a ZeRO-3 checkpoint"), std::string::npos) << bad;
}

}  // namespace
