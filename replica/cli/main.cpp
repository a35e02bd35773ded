// The `replica` program: one entry point for training, launching and diagnostics.
#include "replica/cli/bench_allreduce.h"
#include "replica/cli/env_report.h"
#include "replica/cli/keys_json.h"
#include "replica/cli/llm_command.h"
#include "replica/cli/mds_command.h"
#include "replica/cli/pod_launch.h"
#include "replica/distributed/world.h"
#include "replica/core/error.h"
#include "replica/core/system.h"
#include "replica/launch/launcher.h"
#include "replica/obs/plot.h"
#include "replica/train/run_config.h"
#include "replica/train/task.h"
#include "replica/train/trainer.h"
#include "replica/train/checkpoint.h"

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <c10/util/Exception.h>
#include <cstdio>
#include <iostream>
#include <set>

namespace {

// The registered tasks' names, as `replica keys TASK` takes them.
std::vector<std::string> task_names_list() {
  std::vector<std::string> names;
  for (const auto& spec : replica::train::task_specs()) names.push_back(spec.name);
  return names;
}

// `replica --config run.yaml --max-steps 20 --project-name out/x`: every flag has a YAML twin;
// flags after --config are applied over the file (train::load_config).
replica::train::RunConfig config_with_flags(const std::string& path, const std::vector<std::string>& extras) {
  std::vector<std::pair<std::string, std::string>> flags;
  for (size_t i = 0; i < extras.size(); ++i) {
    std::string arg = extras[i];
    if (arg.rfind("--", 0) != 0) replica::fail("unexpected argument '{}' (flags look like --batch-size 32)", arg);
    arg = arg.substr(2);
    std::string value;
    if (auto eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (i + 1 < extras.size() && extras[i + 1].rfind("--", 0) != 0) {
      value = extras[++i];
    } else {
      value = "true";  // a bare switch such as --overwrite
    }
    flags.emplace_back(arg, value);
  }
  return replica::train::load_config(path, flags);
}

int run_main(int argc, char** argv) {
  CLI::App app{"replica: data-parallel training in C++ on LibTorch (DDP, launcher, trainer)", "replica"};
  app.set_version_flag("--version", std::string("replica ") + REPLICA_VERSION);
  app.require_subcommand(0, 1);
  app.allow_extras();
  std::string config_path;
  app.add_option("--config", config_path, "Run the task a YAML file describes (flags after it override its keys, "
                                         "e.g. --timeline trace.json)")
      ->check(CLI::ExistingFile);

  auto* launch = app.add_subcommand("launch", "Start workers of a program, torchrun-compatible: "
                                              "replica launch [options] -- PROGRAM [ARGS...]");
  std::string nproc = "auto";
  replica::launch::LaunchOptions lopts;
  // Each of these not given takes torchrun's variable for it (PET_NNODES, ...; below), as
  // torchrun does: a PyTorchJob's training operator sets them in every pod (Note [PyTorchJob pods]).
  launch->add_option("--nproc-per-node,--nproc_per_node", nproc, "Workers on this node: N or auto (= usable cores); "
                                                                 "env PET_NPROC_PER_NODE")
      ->capture_default_str();
  launch->add_option("--nnodes", lopts.nnodes, "Number of nodes; env PET_NNODES")->capture_default_str();
  launch->add_option("--node-rank,--node_rank", lopts.node_rank, "This node's rank; env PET_NODE_RANK")
      ->capture_default_str();
  launch->add_option("--master-addr,--master_addr", lopts.master_addr, "Rendezvous host (rank 0's node); "
                                                                       "env PET_MASTER_ADDR")
      ->capture_default_str();
  launch->add_option("--master-port,--master_port", lopts.master_port, "Rendezvous port (0: a free one, one node "
                                                                       "only); env PET_MASTER_PORT")
      ->capture_default_str();
  launch->add_option("--max-restarts,--max_restarts", lopts.max_restarts, "Restarts of the worker group after a "
                                                                         "failure; env PET_MAX_RESTARTS")
      ->capture_default_str();
  launch->add_option("--token", lopts.token, "Rendezvous secret for every worker (default: env REPLICA_TOKEN, "
                                            "or a random one on one node)");
  bool standalone = false;
  launch->add_flag("--standalone", standalone, "One node on loopback with a free rendezvous port");
  launch->add_option("--iface", lopts.iface, "Network interface for collectives (sets GLOO_SOCKET_IFNAME)");
  launch->add_option("--threads-per-worker", lopts.threads_per_worker, "Intra-op threads per worker (0: cores / workers)")
      ->capture_default_str();
  launch->prefix_command();

  auto* bench = app.add_subcommand("bench", "Micro-benchmarks of the communication layer");
  bench->require_subcommand(1);
  auto* bench_ar = bench->add_subcommand("allreduce", "All-reduce bandwidth per size and transport (like nccl-tests)");
  replica::cli::BenchAllreduceOptions bopts;
  std::string bench_nproc = "2";
  bench_ar->add_option("--nproc-per-node,--nproc_per_node", bench_nproc, "Workers (N or auto)")->capture_default_str();
  bench_ar->add_option("--min-bytes", bopts.min_bytes, "Smallest message")->capture_default_str();
  bench_ar->add_option("--max-bytes", bopts.max_bytes, "Largest message")->capture_default_str();
  bench_ar->add_option("--iters", bopts.iterations, "Timed iterations per size")->capture_default_str();
  bench_ar->add_option("--warmup", bopts.warmup, "Untimed iterations per size")->capture_default_str();
  bench_ar->add_option("--transport", bopts.transports, "Transports to measure (shm, gloo)")
      ->check(CLI::IsMember({"shm", "gloo"}))->capture_default_str();
  bench_ar->add_option("--dtype", bopts.dtype, "float32, bfloat16 or float16")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}))->capture_default_str();

  // `replica llm ...` is parsed by llm_command (AutoTrain's flags); listed here for --help.
  app.add_subcommand("llm", "Fine-tune (--train) or evaluate (--eval) an LLM with AutoTrain's flags; "
                            "`replica llm --help`, `replica llm init-demo DIR`");

  auto* tokenize = app.add_subcommand("tokenize", "Token ids of stdin, one text (with --json-lines one JSON string, "
                                                  "with --chat one JSON messages list) per line; one JSON id list "
                                                  "per line on stdout");
  std::string tokenizer_dir, tokenize_template = "tokenizer";
  bool tokenize_chat = false, tokenize_json_lines = false;
  tokenize->add_option("--tokenizer", tokenizer_dir, "Directory with tokenizer.json or tokenizer.model")
      ->required()->check(CLI::ExistingDirectory);
  tokenize->add_flag("--chat", tokenize_chat, "Lines are chats, rendered with the chat template");
  tokenize->add_flag("--json-lines,--json_lines", tokenize_json_lines,
                     "Each line is one text as a JSON string (\"a\\nb\"), so texts may hold line breaks "
                     "(with --chat lines are JSON already)");
  tokenize->add_option("--chat-template,--chat_template", tokenize_template, "tokenizer, chatml or llama3")
      ->check(CLI::IsMember({"tokenizer", "chatml", "llama3"}))->capture_default_str();

  auto* merge = app.add_subcommand("merge-adapter", "Fold a PEFT LoRA adapter into its base model: a plain "
                                                    "Hugging Face model directory");
  std::string merge_model, merge_adapter, merge_out;
  merge->add_option("--model", merge_model, "Base model directory")->required()->check(CLI::ExistingDirectory);
  merge->add_option("--adapter", merge_adapter, "PEFT adapter directory (adapter_config.json, "
                                                "adapter_model.safetensors)")
      ->required()->check(CLI::ExistingDirectory);
  merge->add_option("--out", merge_out, "Output model directory")->required();

  auto* mds = app.add_subcommand("mds", "MDS shards (Mosaic Streaming format): convert JSONL/CSV, write the "
                                        "synthetic recommender data");
  auto mds_command = replica::cli::add_mds_command(*mds);
  auto* plot_cmd = app.add_subcommand("plot", "Render a run's metrics.jsonl (loss, learning rate, throughput, eval "
                                              "metrics) to PROJECT_DIR/metrics.png with gnuplot");
  std::string plot_dir, plot_format = "png";
  plot_cmd->add_option("PROJECT_DIR", plot_dir, "A run's project directory (holds metrics.jsonl)")->required();
  plot_cmd->add_option("--format", plot_format, "png or svg")->check(CLI::IsMember({"png", "svg"}))->capture_default_str();
  auto* consolidate = app.add_subcommand("consolidate", "Join a ZeRO-3 checkpoint's shards into what DDP saves: "
                                                       "the full model, or the PEFT adapter of a LoRA run");
  std::string consolidate_dir, consolidate_out;
  consolidate->add_option("CHECKPOINT_DIR", consolidate_dir, "checkpoint-STEP directory (holding zero/)")
      ->required()->check(CLI::ExistingDirectory);
  consolidate->add_option("OUT", consolidate_out, "Output .safetensors file")->required();

  auto* keys_cmd = app.add_subcommand("keys", "Every params: key of a task (its flag, value, default and what it "
                                              "does), as `replica --config` and `replica llm` take them");
  std::string keys_task;
  bool keys_as_json = false;
  keys_cmd->add_flag("--json", keys_as_json, "As JSON for programs: every key with its flag, help, kind and typed "
                                             "default, the run's own flags and the params twins");
  keys_cmd->add_option("TASK", keys_task, "llm-sft, image-classification or two-tower")
      ->required()
      ->check(CLI::IsMember(task_names_list()));

  auto* env_cmd = app.add_subcommand("env", "Print the environment report for bug reports");
  std::string format = "text";
  env_cmd->add_option("--format", format, "text or json")->check(CLI::IsMember({"text", "json"}));

  // `replica launch [options] -- PROGRAM ARGS`: everything after the first `--` is the
  // program's, untouched by option parsing.
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && args.front() == "llm") {
    std::vector<std::string> self = {"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) self.emplace_back(argv[i]);
    return replica::cli::llm_command(std::vector<std::string>(args.begin() + 1, args.end()), self);
  }
  std::vector<std::string> program;
  if (!args.empty() && args.front() == "launch") {
    auto dash = std::find(args.begin(), args.end(), "--");
    if (dash != args.end()) {
      program.assign(dash + 1, args.end());
      args.erase(dash, args.end());
    }
  }
  try {
    std::reverse(args.begin(), args.end());  // CLI11 takes a reversed vector
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the message (or the help); every error exits 1 like replica's own errors,
    // not CLI11's codes (105 for an unknown flag), --help and --version 0.
    return app.exit(e) == 0 ? 0 : 1;
  }

  if (*launch) {
    // Before `--` everything is the launcher's: an option it does not know is an error, not
    // something to drop silently.
    if (!program.empty() && !launch->remaining().empty()) {
      replica::fail("replica launch: unknown option '{}' before `--` (see replica launch --help)",
                    launch->remaining().front());
    }
    std::vector<std::string> command = program.empty() ? launch->remaining() : program;
    if (command.empty()) replica::fail("replica launch: no program given (replica launch [options] -- PROGRAM [ARGS...])");
    // torchrun's variables for the options not given (Note [PyTorchJob pods]); --standalone
    // ignores them, as torchrun's does.
    if (!standalone) {
      using replica::cli::torchrun_env_int;
      if (launch->count("--nproc-per-node") == 0) nproc = replica::env("PET_NPROC_PER_NODE").value_or(nproc);
      if (launch->count("--nnodes") == 0) lopts.nnodes = torchrun_env_int("PET_NNODES").value_or(lopts.nnodes);
      if (launch->count("--node-rank") == 0) lopts.node_rank = torchrun_env_int("PET_NODE_RANK").value_or(lopts.node_rank);
      if (launch->count("--master-addr") == 0) {
        lopts.master_addr = replica::env("PET_MASTER_ADDR").value_or(lopts.master_addr);
      }
      if (launch->count("--master-port") == 0) {
        lopts.master_port = torchrun_env_int("PET_MASTER_PORT").value_or(lopts.master_port);
      }
      if (launch->count("--max-restarts") == 0) {
        lopts.max_restarts = torchrun_env_int("PET_MAX_RESTARTS").value_or(lopts.max_restarts);
      }
    }
    lopts.nproc_per_node = replica::launch::resolve_nproc(nproc);
    lopts.command = command;
    if (standalone) {
      // torchrun's --standalone: one node, loopback, a port nobody else holds (no 29500 clashes).
      if (lopts.nnodes != 1 || lopts.master_port != 0) {
        replica::fail("replica launch: --standalone is one node on a free port; it cannot be combined with "
                      "--nnodes {} or --master-port {}", lopts.nnodes, lopts.master_port);
      }
      lopts.master_addr = "127.0.0.1";
    }
    return replica::launch::run(lopts);
  }
  if (*bench_ar) {
    if (replica::distributed::world_from_env()) return replica::cli::bench_allreduce_worker(bopts);
    replica::launch::LaunchOptions opts;
    opts.nproc_per_node = replica::launch::resolve_nproc(bench_nproc, /*gpus=*/0);  // CPU transports
    opts.threads_per_worker = 1;
    opts.command = {"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) opts.command.emplace_back(argv[i]);
    return replica::launch::run(opts);
  }
  if (*tokenize) {
    return replica::cli::tokenize_command(tokenizer_dir, tokenize_chat, tokenize_template, tokenize_json_lines);
  }
  if (*merge) return replica::cli::merge_adapter_command(merge_model, merge_adapter, merge_out);
  if (*mds) return replica::cli::run_mds_command(*mds_command);
  if (*plot_cmd) {
    const auto plot = replica::obs::plot_metrics(plot_dir, plot_format);
    if (!plot.written) {
      std::cerr << "replica plot: " << plot.note << "\n";
      return 1;
    }
    std::cout << plot.path << "\n";
    return 0;
  }
  if (*consolidate) {
    for (const auto& written : replica::train::consolidate_checkpoint(consolidate_dir, consolidate_out)) {
      std::cout << written << "\n";
    }
    return 0;
  }
  if (*keys_cmd) {
    const std::string& task = keys_task;
    if (keys_as_json) {
      std::cout << replica::cli::keys_json(task);
      return 0;
    }
    std::cout << "params: keys of task " << keys_task << " (defaults in brackets; YAML writes them with "
              << "underscores under params:)\n"
              << replica::train::keys_help(task);
    return 0;
  }
  if (*env_cmd) {
    std::cout << replica::cli::env_report(format == "json");
    return 0;
  }
  if (!config_path.empty()) {
    auto config = config_with_flags(config_path, app.remaining());
    std::vector<std::string> self = {"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) self.emplace_back(argv[i]);
    if (auto code = replica::cli::run_in_pytorchjob_pod(config, self)) return *code;
    return replica::train::run(config, self);
  }
  if (!app.remaining().empty()) replica::fail("unexpected argument '{}'; see replica --help", app.remaining().front());
  std::cout << app.help();
  return 0;
}

}  // namespace

// One line on stderr for a failure, naming the rank in a multi-worker run; `record` (with
// LibTorch's stack trace, when there is one) goes to the worker's error file. Exit code 1.
static int report_failure(const std::string& message, const std::string& record) {
  const auto rank = replica::env_int("RANK");
  const auto world = replica::env_int("WORLD_SIZE");
  std::string who = rank && world && *world > 1 ? fmt::format("rank {}: ", *rank) : "";
  if (!who.empty() && message.rfind(who, 0) == 0) who.clear();  // the message names its rank already
  std::fputs(("error: " + who + message + "\n").c_str(), stderr);
  std::fflush(stderr);
  replica::write_worker_error_file(record);
  return 1;
}

int main(int argc, char** argv) {
  // stderr line-buffered: each line (a log line, whose colour codes spdlog writes in three
  // pieces, or an error line) reaches the terminal in one write(2), so that the lines of
  // workers sharing a terminal or pipe interleave whole, never mid-line.
  std::setvbuf(stderr, nullptr, _IOLBF, 1 << 16);
  // Logs go to stderr: stdout is for results (replica env, tokenize, llm --eval).
  spdlog::set_default_logger(spdlog::stderr_color_mt("replica"));
  spdlog::set_pattern("%^[%H:%M:%S %l]%$ %v");
  try {
    return run_main(argc, argv);
  } catch (const c10::Error& e) {
    // LibTorch's message on the terminal; its C++ stack trace only in the error file.
    return report_failure(e.what_without_backtrace(), e.what());
  } catch (const std::exception& e) {  // replica::Error and anything the system threw
    return report_failure(e.what(), e.what());
  }
}
