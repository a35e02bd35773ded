// What users see around a training run, through the real `replica` program: the progress bar
// on a terminal (a pseudo-terminal) and plain lines on a pipe, metrics.jsonl's fields,
// TensorBoard event files read back record by record, the plot at the end of a run,
// `--timeline` traces of two workers, `replica env` and its reference-BLAS warning.
#include "replica/obs/tests/event_file_reader.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <pty.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace fs = std::filesystem;

namespace {

constexpr const char* kFashionMnist = "/usr/share/datasets/fashion-mnist";
using replica::testing::Result;
using replica::testing::run_program;

using replica::testing::read_file;

std::vector<nlohmann::json> metrics_of(const fs::path& project) {
  std::vector<nlohmann::json> out;
  std::istringstream in(read_file(project / "metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

// Runs `program args` with stdout and stderr on a new pseudo-terminal (as in a terminal
// window or tmux), everything it writes there, and its exit code; bounded by `limit`.
std::pair<int, std::string> run_in_terminal(const std::vector<std::string>& args, std::chrono::seconds limit) {
  std::vector<std::string> argv_s = {REPLICA_BIN};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s = replica::testing::child_environment();
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);

  int master = -1;
  winsize ws{};
  ws.ws_col = 120;
  ws.ws_row = 40;
  const pid_t pid = forkpty(&master, nullptr, nullptr, &ws);
  if (pid < 0) {
    ADD_FAILURE() << "forkpty: " << std::strerror(errno);
    return {-1, ""};
  }
  if (pid == 0) {
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  char buf[4096];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      ADD_FAILURE() << "the run in a terminal did not finish within " << limit.count() << " s\n" << out;
      kill(pid, SIGKILL);
      break;
    }
    pollfd p{master, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    const ssize_t n = read(master, buf, sizeof buf);
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;  // EIO: every holder of the terminal's other end has exited
    }
  }
  close(master);
  int status = 0;
  waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

class Observability : public replica::testing::ScratchDirTest {
 protected:
  Observability() : ScratchDirTest("replica-obs") {}
  void SetUp() override {
    ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built (cmake --build builds it)";
    ScratchDirTest::SetUp();
  }

  // A short SGD run on Fashion-MNIST; with eval_every > 0 it evaluates on t10k every that
  // many steps, otherwise not at all (max_steps ends the run long before an epoch would).
  fs::path write_config(const std::string& log, int steps, const std::string& hidden = "[64]",
                        int eval_every = 0) {
    std::ostringstream y;
    y << "task: image-classification\nbackend: local\nmodel: mlp\n"
      << "project_name: " << (dir_ / "project").string() << "\n"
      << "log: " << log << "\n"
      << "data:\n  path: " << kFashionMnist << "\n  train_split: train\n"
      << "  valid_split: " << (eval_every > 0 ? "t10k" : "null") << "\n"
      << "params:\n  nproc_per_node: 1\n  max_steps: " << steps << "\n  batch_size: 32\n"
      << "  optimizer: sgd\n  lr: 0.05\n  scheduler: linear\n  threads_per_worker: 1\n"
      << "  checkpoint_every: 0\n  logging_steps: 2\n  eval_every: " << eval_every << "\n"
      << "  hidden_sizes: " << hidden << "\n";
    const fs::path file = dir_ / "run.yaml";
    std::ofstream(file) << y.str();
    return file;
  }

  Result replica(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {}) {
    return run_program(REPLICA_BIN, args, env, std::chrono::seconds(120));
  }

};

}  // namespace

TEST_F(Observability, MetricsHaveEveryFieldAndTensorBoardEventsParseBack) {
  const fs::path cfg = write_config("tensorboard", 10, "[64]", 10);
  const fs::path project = dir_ / "tb";
  const Result r = replica({"--config", cfg.string(), "--project-name", project.string()});
  ASSERT_EQ(r.exit_code, 0) << r;

  // metrics.jsonl: every logged step has the full set of fields, the time split included.
  std::map<int64_t, nlohmann::json> train;
  nlohmann::json eval;
  for (const auto& j : metrics_of(project)) {
    if (j.contains("loss")) train[j.at("step").get<int64_t>()] = j;
    if (j.contains("eval_loss")) eval = j;
  }
  ASSERT_EQ(train.size(), 5u);  // logging_steps 2, 10 steps
  for (const auto& [step, j] : train) {
    for (const char* key : {"epoch", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "time_compute_s",
                            "time_comm_wait_s", "time_data_wait_s", "time_optimizer_s"}) {
      ASSERT_TRUE(j.contains(key) && j.at(key).is_number()) << "step " << step << " lacks " << key << ": " << j;
    }
    EXPECT_GT(j.at("grad_norm").get<double>(), 0) << j;  // clipping is on (max_grad_norm 1.0)
    EXPECT_GT(j.at("samples_per_s").get<double>(), 0) << j;
    EXPECT_GT(j.at("time_compute_s").get<double>(), 0) << j;
    EXPECT_GE(j.at("time_comm_wait_s").get<double>(), 0) << j;
    EXPECT_GE(j.at("time_data_wait_s").get<double>(), 0) << j;
    EXPECT_GT(j.at("time_optimizer_s").get<double>(), 0) << j;
  }
  ASSERT_TRUE(eval.is_object());

  // One event file in the project; every record's framing checks out, and its scalars are
  // metrics.jsonl's values under TensorBoard's tags.
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(project)) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(e.path());
  }
  ASSERT_EQ(files.size(), 1u);
  const auto records = replica::testing::read_records(files[0].string());
  ASSERT_GT(records.size(), 1u);
  std::map<std::string, std::map<int64_t, float>> scalars;
  for (size_t i = 1; i < records.size(); ++i) {
    const auto s = replica::testing::decode_scalar(records[i]);
    scalars[s.tag][s.step] = s.value;
  }
  for (const char* tag : {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/time_compute_s",
                          "eval/loss", "eval/accuracy"}) {
    EXPECT_TRUE(scalars.count(tag)) << "no " << tag << " in " << files[0];
  }
  for (const auto& [step, j] : train) {
    EXPECT_EQ(scalars["train/loss"][step], static_cast<float>(j.at("loss").get<double>())) << "step " << step;
    EXPECT_EQ(scalars["train/lr"][step], static_cast<float>(j.at("lr").get<double>())) << "step " << step;
  }
  EXPECT_EQ(scalars["eval/accuracy"][10], static_cast<float>(eval.at("eval_accuracy").get<double>()));

  // The run ended with its plot.
  const std::string png = read_file(project / "metrics.png");
  ASSERT_GT(png.size(), 8u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_NE(r.err.find("plot: " + (project / "metrics.png").string()), std::string::npos) << r;
}

TEST_F(Observability, WandbIsRefusedNamingTheLoggersThereAre) {
  const fs::path cfg = write_config("wandb", 2);
  const Result r = replica({"--config", cfg.string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_NE(r.err.find("log 'wandb' is not available"), std::string::npos) << r;
  EXPECT_NE(r.err.find("none, jsonl, tensorboard"), std::string::npos) << r;
}

TEST_F(Observability, ProgressIsALiveBarOnATerminalAndPlainLinesOnAPipe) {
  const fs::path cfg = write_config("jsonl", 20);
  const auto [code, screen] = run_in_terminal({"--config", cfg.string(), "--project-name", (dir_ / "tty").string()},
                                              std::chrono::seconds(120));
  ASSERT_EQ(code, 0) << screen;
  // Redrawn in place (carriage return, erase to end of line), ending full.
  EXPECT_NE(screen.find("\r  5% |"), std::string::npos) << screen;  // the first step is drawn at once
  EXPECT_NE(screen.find(" 1/20 epoch "), std::string::npos) << screen;
  EXPECT_NE(screen.find("100% |"), std::string::npos) << screen;
  EXPECT_NE(screen.find(" 20/20 epoch "), std::string::npos) << screen;
  EXPECT_NE(screen.find("samples/s ETA "), std::string::npos) << screen;
  EXPECT_NE(screen.find("\x1b[K"), std::string::npos) << screen;
  EXPECT_EQ(screen.find("info] step 20/20"), std::string::npos) << "plain lines on a terminal:\n" << screen;

  const Result piped = replica({"--config", cfg.string(), "--project-name", (dir_ / "pipe").string()});
  ASSERT_EQ(piped.exit_code, 0) << piped;
  EXPECT_EQ(piped.err.find('\r'), std::string::npos) << piped;
  EXPECT_EQ(piped.err.find("% |"), std::string::npos) << piped;
  for (int step = 2; step <= 20; step += 2) {
    EXPECT_NE(piped.err.find("info] step " + std::to_string(step) + "/20 epoch "), std::string::npos) << piped;
  }
}

// Two workers on one terminal: rank 0 draws the bar; the other rank's lines (its memory
// report at the end) start on a line of their own, never glued to the bar.
TEST_F(Observability, OtherRanksLinesAreNotGluedToTheBar) {
  const fs::path cfg = write_config("jsonl", 10);
  const auto [code, screen] = run_in_terminal({"--config", cfg.string(), "--project-name", (dir_ / "tty2").string(),
                                               "--nproc-per-node", "2"},
                                              std::chrono::seconds(120));
  ASSERT_EQ(code, 0) << screen;
  EXPECT_NE(screen.find("100% |"), std::string::npos) << screen;
  int rank1_lines = 0;
  for (size_t at = screen.find("rank 1: backend"); at != std::string::npos; at = screen.find("rank 1: backend", at + 1)) {
    ++rank1_lines;
    const size_t line_start = screen.rfind('\n', at);
    const std::string before = screen.substr(line_start == std::string::npos ? 0 : line_start + 1,
                                             at - (line_start == std::string::npos ? 0 : line_start + 1));
    EXPECT_EQ(before.find("% |"), std::string::npos) << "glued to the bar: " << before << "\n" << screen;
  }
  EXPECT_GE(rank1_lines, 1) << screen;
}

TEST_F(Observability, PlotCommandAndAMissingGnuplot) {
  const fs::path cfg = write_config("jsonl", 6);
  const fs::path project = dir_ / "p";
  // Without gnuplot the run still succeeds, with a one-line note.
  const Result r = replica({"--config", cfg.string(), "--project-name", project.string()},
                           {{"REPLICA_GNUPLOT", "/nonexistent/gnuplot"}});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_NE(r.err.find("no plot: gnuplot not found (apt-get install gnuplot-nox)"), std::string::npos) << r;
  EXPECT_FALSE(fs::exists(project / "metrics.png"));

  const Result plot = replica({"plot", project.string(), "--format", "svg"});
  ASSERT_EQ(plot.exit_code, 0) << plot;
  EXPECT_EQ(plot.out, (project / "metrics.svg").string() + "\n");
  const std::string svg = read_file(project / "metrics.svg");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("learning rate"), std::string::npos);

  const Result missing = replica({"plot", (dir_ / "nothing").string()});
  EXPECT_EQ(missing.exit_code, 1) << missing;
  EXPECT_NE(missing.err.find((dir_ / "nothing" / "metrics.jsonl").string()), std::string::npos) << missing;
}

TEST_F(Observability, TimelineShowsEachRanksPhasesAndBucketsOverlappingBackward) {
  // 784-512-512-10: ~0.67 M parameters, more than DDP's first 1 MB bucket holds, so backward
  // launches several buckets.
  const fs::path cfg = write_config("jsonl", 4, "[512, 512]");
  const fs::path trace_file = dir_ / "trace" / "timeline.json";
  const Result r = replica({"--config", cfg.string(), "--project-name", (dir_ / "t").string(), "--nproc-per-node", "2",
                            "--timeline", trace_file.string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  const auto trace = nlohmann::json::parse(read_file(trace_file));
  std::map<int, std::map<std::string, std::vector<std::pair<int64_t, int64_t>>>> spans;  // rank -> name -> [ts, end)
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const int64_t ts = e.at("ts").get<int64_t>();
    spans[e.at("pid").get<int>()][e.at("name").get<std::string>()].emplace_back(ts, ts + e.at("dur").get<int64_t>());
  }
  ASSERT_EQ(spans.size(), 2u) << "ranks in the trace";
  for (auto& [rank, by_name] : spans) {
    for (const char* name : {"data", "forward", "backward", "comm wait", "optimizer step"}) {
      EXPECT_EQ(by_name[name].size(), 4u) << "rank " << rank << ": " << name;
    }
    std::set<std::string> buckets;
    bool overlaps_backward = false;
    for (const auto& [name, list] : by_name) {
      if (name.rfind("allreduce bucket ", 0) != 0) continue;
      buckets.insert(name);
      for (const auto& [b_start, b_end] : list) {
        for (const auto& [bw_start, bw_end] : by_name["backward"]) {
          // Launched from a gradient hook while backward still ran.
          if (b_start >= bw_start && b_start < bw_end && b_end <= bw_end) overlaps_backward = true;
        }
      }
    }
    EXPECT_GE(buckets.size(), 2u) << "rank " << rank;
    EXPECT_TRUE(overlaps_backward) << "rank " << rank;
  }
}

TEST_F(Observability, EnvReportNamesTheBlasAndWarnsOnTheReferenceOne) {
  const Result json = replica({"env", "--format", "json"}, {{"MASTER_PORT", "29400"}, {"REPLICA_TOKEN", "s3cret"}});
  ASSERT_EQ(json.exit_code, 0) << json;
  const auto j = nlohmann::json::parse(json.out);
  for (const char* key : {"replica_version", "libtorch_version", "cpu", "blas", "backends", "gpus",
                          "network_interfaces", "environment", "warnings"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  for (const char* backend : {"gloo", "nccl", "mpi", "shm"}) EXPECT_TRUE(j["backends"].contains(backend)) << backend;
  EXPECT_EQ(j["backends"]["gloo"]["available"], true);
  EXPECT_EQ(j["environment"]["MASTER_PORT"], "29400");
  EXPECT_EQ(json.out.find("s3cret"), std::string::npos) << "the rendezvous secret leaked";
  bool loopback = false;
  for (const auto& n : j["network_interfaces"]) loopback = loopback || n["name"] == "lo";
  EXPECT_TRUE(loopback);
  const std::string blas = j["blas"]["name"];
  EXPECT_TRUE(blas == "openblas" || blas == "reference" || blas == "mkl" || blas == "blis") << blas;

  // The reference BLAS picked by the loader (as update-alternatives would): a loud warning
  // where LibTorch calls a shared BLAS; LibTorch with MKL inside (PyTorch's wheels) keeps MKL.
  const Result slow = replica({"env"}, {{"LD_LIBRARY_PATH", "/usr/lib/x86_64-linux-gnu/blas"}});
  ASSERT_EQ(slow.exit_code, 0) << slow;
  if (j["blas"]["path"].get<std::string>().rfind("MKL, statically linked into", 0) == 0) {
    EXPECT_NE(slow.out.find("BLAS:                mkl (MKL, statically linked into"), std::string::npos) << slow;
    EXPECT_EQ(slow.out.find("REFERENCE BLAS"), std::string::npos) << slow;
    EXPECT_EQ(slow.out.find("no BLAS library"), std::string::npos) << slow;
    return;
  }
  EXPECT_NE(slow.out.find("BLAS:                reference (/usr/lib/x86_64-linux-gnu/blas/libblas.so"),
            std::string::npos) << slow;
  EXPECT_NE(slow.out.find("WARNING: LibTorch is using the REFERENCE BLAS"), std::string::npos) << slow;
}

// `replica bench allreduce`: bf16 over both transports at world 2 (LibTorch 2.x's Gloo sums
// bf16), and one table, not one per transport, for a single worker (nothing is transported).
TEST_F(Observability, BenchAllreduceTablesPerTransport) {
  const Result bf16 = replica({"bench", "allreduce", "--nproc-per-node", "2", "--dtype", "bfloat16",
                               "--max-bytes", "65536", "--iters", "3", "--warmup", "1"});
  ASSERT_EQ(bf16.exit_code, 0) << bf16;
  EXPECT_NE(bf16.out.find("transport shm, world 2, dtype bfloat16"), std::string::npos) << bf16;
  EXPECT_NE(bf16.out.find("transport gloo, world 2, dtype bfloat16"), std::string::npos) << bf16;
  const Result one = replica({"bench", "allreduce", "--nproc-per-node", "1", "--max-bytes", "65536",
                              "--iters", "3", "--warmup", "1"});
  ASSERT_EQ(one.exit_code, 0) << one;
  size_t tables = 0;
  for (size_t at = one.out.find("# replica bench allreduce:"); at != std::string::npos;
       at = one.out.find("# replica bench allreduce:", at + 1)) {
    ++tables;
  }
  EXPECT_EQ(tables, 1u) << one;
}
