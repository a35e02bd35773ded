// Issue 21: the docs cannot drift from the program. Every command line README.md and the guide
// in docs/*.md show in a fenced block, every complete run config among their ```yaml blocks and
// every examples/*.yaml runs here through the real `replica`: README first, then the guide's
// pages by name, each in its own order (later commands use what earlier ones wrote: data, demo
// model, a run's final/), in one scratch directory holding a copy of examples/ and bench/, so
// relative paths resolve as in a checkout. A command or config shown on several pages (issue 36:
// README's quickstart is also the guide's) runs once, where it is first shown. Trainings are cut
// to a few steps and each runs four times: fp32 and bf16, at world 1 and 2. What cannot run here
// is skipped by a listed rule and printed; a skipped synopsis must be one of the known forms, so
// a new runnable command is never skipped silently.
#include "replica/testing/program_runner.h"
#include "replica/testing/paths.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

using replica::testing::Result;

const fs::path kSource = REPLICA_SOURCE_DIR;

// One thing to run: the program's arguments (the program is REPLICA_BIN) and where it is shown.
struct Command {
  std::string where;              // README.md:241, docs/llm.md:12, examples/x.yaml
  std::string shown;              // as the docs show it
  std::vector<std::string> args;  // after the program name
  std::string yaml;               // a ```yaml block of the docs: written to args[1] first
};

struct Skip {
  std::string where, shown, why;
};

struct Plan {
  std::vector<Command> run;
  std::vector<Skip> skipped;
  std::vector<std::string> problems;  // lines this test does not know how to treat
};

// Lines that cannot run here for a reason outside replica, by regex on the command text.
const std::vector<std::pair<std::string, std::string>> kOutsideRules = {
    {R"(^(\./)?scripts/(setup|test)\.sh\b)", "installs packages (apt-get, pip) and builds: CI's own job"},
    {R"(^(cmake|pip3?|python3?|ctest|git)\b)", "a build or packaging tool, not replica"},
    {R"(^/opt/replica/)", "the installed copy (cmake --install build --prefix /opt/replica first)"},
    {R"(--master-addr (?!127\.0\.0\.1\b|localhost\b)[0-9a-z])",
     "several hosts (another node's --master-addr); FaultTolerance.TwoNodesInTwoNetworkNamespacesMatchOneNode"},
    {R"(^mpirun\b)", "mpirun on the reader's run.yaml; FaultTolerance.MpirunWorkersMatchTheLauncher"},
    {R"(^srun\b)", "Slurm's srun (no Slurm here); World.ReadsTorchrunMpiAndSlurmVariables"},
    {R"(^CUDA_VISIBLE_DEVICES=|--device cuda\b)", "GPUs (none here); the gpu tests and scripts/gpu_check.sh"},
    {R"(\|\s*(\./build/)?replica\b)", "another program's output on stdin; replica tokenize's own tests feed it"},
};

// The synopses the docs show, by their start. A line skipped for its placeholders that starts
// otherwise fails the test: it is a new synopsis to list here, or a runnable command that
// should not have been caught.
const std::vector<std::string> kSynopses = {
    "replica --config run.yaml [",      "replica launch [",
    "replica env [",                    "replica bench allreduce [",
    "replica llm --train --model DIR",  "replica llm --eval --model DIR",
    "replica llm init-demo DIR",        "replica tokenize --tokenizer DIR",
    "replica merge-adapter --model DIR", "replica mds convert --input events.jsonl",
    "replica llm ... /",                "replica mds synthetic|convert ...",
    "replica consolidate CHECKPOINT_DIR", "replica plot PROJECT_DIR",
    "replica mds convert INPUT OUT",    "replica mds synthetic OUT",
    "replica keys llm-sft|",
};

// The docs' runnable commands and configs today (their own and those left of a synopsis without
// its optional parts, each counted once); fewer means a command stopped being found.
constexpr size_t kMinDocsCommands = 17;

using replica::testing::read_file;

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::vector<std::string> words_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

std::string join(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

// A word the reader fills in: DIR, PATH, OUT.safetensors, N|auto, ARGS..., <x>, run.yaml.
std::string placeholder_in(const std::vector<std::string>& words) {
  static const std::regex upper(R"([A-Z][A-Z0-9_]*(\.[a-z]+)?)");
  for (const auto& w : words) {
    if (std::regex_match(w, upper) || w.find("...") != std::string::npos || w.find('<') != std::string::npos ||
        w.find('|') != std::string::npos || w == "run.yaml") {
      return w;
    }
  }
  return "";
}

// The synopsis without its [optional] parts, one command per `A / B` alternative.
std::vector<std::vector<std::string>> cores_of(const std::vector<std::string>& words) {
  std::vector<std::string> core;
  int depth = 0;
  for (const auto& w : words) {
    const int opens = static_cast<int>(std::count(w.begin(), w.end(), '['));
    const int closes = static_cast<int>(std::count(w.begin(), w.end(), ']'));
    if (depth == 0 && opens == 0) core.push_back(w);
    depth += opens - closes;
  }
  const auto slash = std::find(core.begin(), core.end(), "/");
  if (slash == core.end() || slash == core.begin() || slash + 1 == core.end()) return {core};
  std::vector<std::string> first(core.begin(), slash), second(core.begin(), slash - 1);
  second.insert(second.end(), slash + 1, core.end());
  return {first, second};
}

bool is_program(const std::string& word) { return word == "replica" || word == "./build/replica"; }

// One shell command (a part of a line between &&) at `where` (page:line).
void classify(const std::string& text, const std::string& where, Plan& plan) {
  for (const auto& [pattern, why] : kOutsideRules) {
    if (std::regex_search(text, std::regex(pattern))) {
      plan.skipped.push_back({where, text, why});
      return;
    }
  }
  const auto words = words_of(text);
  const bool mentions = std::any_of(words.begin(), words.end(), [](const std::string& w) {
    return w == "replica" || (w.size() > 8 && w.compare(w.size() - 8, 8, "/replica") == 0);
  });
  if (words.empty() || !mentions) return;  // not a command: a file tree, a log line
  if (!is_program(words[0])) {
    plan.problems.push_back(where + ": runs replica in a way this test does not know: " + text);
    return;
  }
  if (words.size() > 1 && words[1].back() == ':') {
    plan.skipped.push_back({where, text, "the program's output, not a command"});
    return;
  }
  const std::string hole = text.find('[') != std::string::npos ? "[...]" : placeholder_in(words);
  if (hole.empty()) {
    for (const auto& alt : cores_of(words)) plan.run.push_back({where, join(alt), {alt.begin() + 1, alt.end()}, ""});
    return;
  }
  plan.skipped.push_back({where, text, "synopsis: " + hole + " is the reader's to fill in or choose"});
  const std::string normal = "replica" + text.substr(words[0].size());
  if (std::none_of(kSynopses.begin(), kSynopses.end(),
                   [&](const std::string& s) { return normal.rfind(s, 0) == 0; })) {
    plan.problems.push_back(where + ": skipped as a synopsis but not a known one (kSynopses): " + text);
  }
  for (const auto& core : cores_of(words)) {
    if (placeholder_in(core).empty()) {
      plan.run.push_back({where + " (optional parts left out)", join(core), {core.begin() + 1, core.end()}, ""});
    }
  }
}

// Every command of a page's fenced blocks (C++, CMake and Python excluded) and its complete
// ```yaml run configs, appended to `plan`. `page` is relative to the checkout.
void plan_page(const std::string& page, Plan& plan) {
  std::istringstream in(read_file(kSource / page));
  std::string line, fence, yaml, pending;
  int n = 0, fence_line = 0, pending_line = 0;
  bool inside = false;
  while (std::getline(in, line)) {
    ++n;
    if (trim(line).rfind("```", 0) == 0) {
      if (inside && fence == "yaml" && std::regex_search(yaml, std::regex(R"((^|\n)task:)"))) {
        std::string file = page.substr(page.rfind('/') + 1);
        file = file.substr(0, file.size() - 3) + "-" + std::to_string(fence_line) + ".yaml";
        std::transform(file.begin(), file.end(), file.begin(), [](unsigned char c) { return std::tolower(c); });
        plan.run.push_back(
            {page + ":" + std::to_string(fence_line), "```yaml block as " + file, {"--config", file}, yaml});
      }
      inside = !inside;
      fence = trim(trim(line).substr(3));
      fence_line = n;
      yaml.clear();
      continue;
    }
    if (!inside || fence == "cpp" || fence == "cmake" || fence == "python") continue;  // code, not command lines
    if (fence == "yaml") {
      yaml += line + "\n";
      continue;
    }
    // A comment starts at a '#' that opens a word; a trailing '\' continues the command.
    static const std::regex comment(R"((^|\s)#.*$)");
    std::string text = trim(std::regex_replace(line, comment, ""));
    if (pending.empty()) pending_line = n;
    if (!text.empty() && text.back() == '\\') {
      pending += text.substr(0, text.size() - 1) + " ";
      continue;
    }
    text = trim(pending + text);
    pending.clear();
    size_t from = 0;
    for (size_t at; (at = text.find("&&", from)) != std::string::npos; from = at + 2) {
      classify(trim(text.substr(from, at - from)), page + ":" + std::to_string(pending_line), plan);
    }
    classify(trim(text.substr(from)), page + ":" + std::to_string(pending_line), plan);
  }
}

// README.md, then docs/*.md by name; what a page shows again is skipped for where it ran first.
Plan plan_docs() {
  std::vector<std::string> pages;
  for (const auto& e : fs::directory_iterator(kSource / "docs")) {
    if (e.path().extension() == ".md") pages.push_back("docs/" + e.path().filename().string());
  }
  std::sort(pages.begin(), pages.end());
  pages.insert(pages.begin(), "README.md");
  Plan all;
  for (const auto& page : pages) plan_page(page, all);
  Plan plan;
  plan.skipped = all.skipped;
  plan.problems = all.problems;
  for (const auto& c : all.run) {
    const auto first = std::find_if(plan.run.begin(), plan.run.end(),
                                    [&](const Command& r) { return r.args == c.args && r.yaml == c.yaml; });
    if (first == plan.run.end()) {
      plan.run.push_back(c);
    } else {
      plan.skipped.push_back({c.where, c.shown, "shown again: runs at " + first->where});
    }
  }
  return plan;
}

bool has(const std::vector<std::string>& args, const std::string& flag) {
  return std::find(args.begin(), args.end(), flag) != args.end();
}

bool is_training(const std::vector<std::string>& a) {
  return has(a, "--config") || (!a.empty() && a[0] == "llm" && has(a, "--train"));
}

// The value of the last `--x-y V` / `--x_y V` in args, or "".
std::string flag_value(const std::vector<std::string>& args, const std::string& dashed) {
  std::string underscored = dashed;
  std::replace(underscored.begin() + 2, underscored.end(), '-', '_');
  std::string value;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == dashed || args[i] == underscored) value = args[i + 1];
  }
  return value;
}

class DocsExamples : public replica::testing::ScratchDirTest {
 protected:
  DocsExamples() : ScratchDirTest("replica-docs") {}

  Result run(const std::vector<std::string>& args) {
    return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(180), "", dir_.string());
  }

  // The project a training writes into, as the docs name it (relative to the scratch dir).
  std::string project_of(const std::vector<std::string>& args) {
    std::string p = flag_value(args, "--project-name");
    if (p.empty()) {
      std::smatch m;
      const std::string yaml = read_file(dir_ / flag_value(args, "--config"));
      if (std::regex_search(yaml, m, std::regex(R"((^|\n)project_name:\s*(\S+))"))) p = m[2];
    }
    return p;
  }

  struct Row {
    std::string where, shown, variant;
    double seconds;
    std::string result;
  };
  std::vector<Row> rows_;

  // Runs one command (plus `extra`) and records it; a failure names the command and its output.
  Result run_and_record(const Command& c, const std::string& variant, const std::vector<std::string>& extra) {
    std::vector<std::string> args = c.args;
    args.insert(args.end(), extra.begin(), extra.end());
    const Result r = run(args);
    const std::string line = std::string(REPLICA_BIN) + " " + join(args) + "   (in " + dir_.string() + ")";
    EXPECT_EQ(r.exit_code, 0) << c.where << ": " << c.shown << " [" << variant << "]\n" << line << "\n" << r;
    rows_.push_back({c.where, c.shown, variant, r.seconds, r.exit_code == 0 ? "ok" : "exit " + std::to_string(r.exit_code)});
    return r;
  }
};

TEST_F(DocsExamples, DocsSkipOnlyKnownFormsAndFindEveryCommand) {
  const Plan plan = plan_docs();
  for (const auto& p : plan.problems) ADD_FAILURE() << p;
  EXPECT_GE(plan.run.size(), kMinDocsCommands) << "the docs' runnable commands were not all found";
  for (const auto& c : plan.run) std::cout << "runs    " << c.where << ": " << c.shown << "\n";
  for (const auto& s : plan.skipped) std::cout << "skipped " << s.where << ": " << s.shown << "\n    (" << s.why << ")\n";
}

TEST_F(DocsExamples, EveryDocsCommandAndExampleRunsUnderFp32AndBf16AtWorld1And2) {
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  Plan plan = plan_docs();
  for (const auto& p : plan.problems) ADD_FAILURE() << p;
  fs::copy(kSource / "examples", dir_ / "examples", fs::copy_options::recursive);
  // docs/performance.md runs the product path's benchmark configs.
  fs::create_directories(dir_ / "bench");
  for (const auto& e : fs::directory_iterator(kSource / "bench")) {
    if (e.path().extension() == ".yaml") fs::copy_file(e.path(), dir_ / "bench" / e.path().filename());
  }
  // The reader's own interactions that the docs' `replica mds convert --input events.jsonl` converts.
  std::ofstream(dir_ / "events.jsonl") << R"({"user_id": 1, "item_id": 7, "title": "a"})" << "\n"
                                       << R"({"user_id": 2, "item_id": 3, "title": "b c"})" << "\n";

  // examples/*.yaml that no docs command runs, after the docs' (whose data they may need).
  for (const auto& e : fs::directory_iterator(kSource / "examples")) {
    if (e.path().extension() != ".yaml") continue;
    const std::string rel = "examples/" + e.path().filename().string();
    const auto by = std::find_if(plan.run.begin(), plan.run.end(), [&](const Command& c) { return has(c.args, rel); });
    if (by != plan.run.end()) {
      std::cout << rel << ": run by " << by->where << "\n";
    } else {
      plan.run.push_back({rel, "replica --config " + rel, {"--config", rel}, ""});
    }
  }
  for (const auto& s : plan.skipped) std::cout << "skipped " << s.where << ": " << s.shown << "\n    (" << s.why << ")\n";

  // A few steps, one thread a worker (the machine has 2 cores), a loss line for every step.
  // Evaluation stays as the docs set it: every config evaluates at the end of an epoch, which
  // 3 steps never reach; checkpoints too: every run writes one at its end.
  const std::vector<std::string> kShort = {"--max-steps", "3", "--threads-per-worker", "1", "--logging-steps", "1"};
  // ResNet-18 in micro-batches of 8: bf16 on a CPU without bf16 instructions (AVX512-BF16, AMX;
  // this project's AMD machines have neither) runs its convolutions through slow reference
  // kernels, 3 steps at the example's batch of 64 taking 130-180 s, and the variants must run,
  // not be timed.
  const auto trains_resnet = [](const Command& c) {
    return c.yaml.find("resnet18") != std::string::npos ||
           std::any_of(c.args.begin(), c.args.end(),
                       [](const std::string& a) { return a.find("resnet18") != std::string::npos; });
  };
  const std::vector<std::pair<std::string, int>> kVariants = {{"fp32", 1}, {"bf16", 1}, {"fp32", 2}, {"bf16", 2}};
  std::set<std::string> claimed;  // projects some run already wrote
  size_t trainings = 0, others = 0;
  for (size_t i = 0; i < plan.run.size(); ++i) {
    const Command& c = plan.run[i];
    if (!c.yaml.empty()) std::ofstream(dir_ / c.args[1]) << c.yaml;
    if (!is_training(c.args)) {
      std::vector<std::string> extra;
      if (c.args.size() >= 2 && c.args[0] == "bench" && c.args[1] == "allreduce") {
        extra = {"--iters", "2", "--warmup", "1", "--max-bytes", "65536"};
      }
      run_and_record(c, "-", extra);
      ++others;
      continue;
    }
    const std::string project = project_of(c.args);
    if (project.empty()) {
      ADD_FAILURE() << c.where << ": no project name in " << c.shown;
      continue;
    }
    for (const auto& [precision, world] : kVariants) {
      const std::string variant = precision + " w" + std::to_string(world);
      // fp32 at world 1 writes where the docs say, for the commands after it that read the run.
      std::string out = project;
      if (precision != "fp32" || world != 1 || claimed.count(project)) {
        out = project + "-" + std::to_string(i) + "-" + precision + "-w" + std::to_string(world);
      }
      claimed.insert(out);
      std::vector<std::string> extra = kShort;
      if (trains_resnet(c)) extra.insert(extra.end(), {"--batch-size", "8"});
      extra.insert(extra.end(), {"--mixed-precision", precision, "--nproc-per-node", std::to_string(world),
                                 "--project-name", out});
      const Result r = run_and_record(c, variant, extra);
      ++trainings;
      if (r.exit_code != 0) continue;
      const fs::path p = dir_ / out;
      const std::string metrics = read_file(p / "metrics.jsonl");
      EXPECT_NE(metrics.find("\"loss\""), std::string::npos) << c.where << " [" << variant << "]: no loss line in "
                                                               << p / "metrics.jsonl" << "\n" << r;
      EXPECT_TRUE(fs::is_directory(p / "final")) << c.where << " [" << variant << "]: no " << p / "final" << "\n" << r;
      // The variant reached the run (the flags' spellings are the ones the program takes).
      const auto params = nlohmann::json::parse(read_file(p / "training_params.json"), nullptr, false);
      if (!params.is_object()) {
        ADD_FAILURE() << c.where << " [" << variant << "]: no readable " << p / "training_params.json";
        continue;
      }
      EXPECT_EQ(params.value("mixed_precision", ""), precision) << c.where << " [" << variant << "]";
      EXPECT_EQ(params.value("nproc_per_node", 0), world) << c.where << " [" << variant << "]";
    }
  }

  std::cout << "\n" << std::left << std::setw(40) << "where" << std::setw(62) << "command" << std::setw(9) << "variant"
            << std::setw(9) << "seconds" << "result\n";
  double total = 0;
  for (const auto& row : rows_) {
    const std::string shown = row.shown.size() > 60 ? row.shown.substr(0, 57) + "..." : row.shown;
    std::cout << std::setw(40) << row.where << std::setw(62) << shown << std::setw(9) << row.variant << std::setw(9)
              << std::fixed << std::setprecision(1) << row.seconds << row.result << "\n";
    total += row.seconds;
  }
  std::cout << rows_.size() << " runs (" << trainings << " trainings, " << others << " other commands), "
            << plan.skipped.size() << " lines skipped, " << total << " s\n";
}

}  // namespace

// docs/cli.md says it covers every command and flag: every long option that `--help` of each
// command lists is written there. And no page points at files a clone does not have.
TEST(DocsPages, CliMdNamesEveryFlagOfEveryCommand) {
  const std::string cli = read_file(kSource / "docs" / "cli.md");
  ASSERT_FALSE(cli.empty());
  const std::vector<std::vector<std::string>> commands = {
      {},        {"launch"},      {"env"},   {"bench", "allreduce"}, {"llm"},     {"llm", "init-demo"},
      {"tokenize"}, {"merge-adapter"}, {"mds", "synthetic"}, {"mds", "convert"}, {"consolidate"}, {"plot"},
      {"keys"},
      // Not --help: every params: key of each task, from its key table.
      {"keys", "llm-sft"}, {"keys", "image-classification"}, {"keys", "two-tower"}};
  const std::regex flag(R"((^|[\s,\[])(--[a-z][a-z0-9-]*))");
  int checked = 0;
  for (const auto& command : commands) {
    std::vector<std::string> args = command;
    if (!(command.size() == 2 && command[0] == "keys")) args.push_back("--help");
    const Result r = replica::testing::run_program(REPLICA_BIN, args);
    ASSERT_EQ(r.exit_code, 0) << r;
    for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), flag); it != std::sregex_iterator(); ++it) {
      const std::string name = (*it)[2].str();
      if (name == "--help" || name == "--x-y") continue;
      EXPECT_NE(cli.find(name), std::string::npos) << "docs/cli.md does not mention " << name << " of `replica "
                                                   << join(command) << "`";
      ++checked;
    }
  }
  EXPECT_GT(checked, 150);
}

TEST(DocsPages, NoLinkToFilesOutsideTheRepositoryAndNoStaleStore) {
  std::vector<fs::path> pages = {kSource / "README.md"};
  for (const auto& e : fs::directory_iterator(kSource / "docs")) {
    if (e.path().extension() == ".md") pages.push_back(e.path());
  }
  for (const auto& page : pages) {
    const std::string text = read_file(page);
    EXPECT_EQ(text.find("PRODUCT.md"), std::string::npos) << page << " links to PRODUCT.md, which is not in a clone";
    EXPECT_EQ(text.find("../shared"), std::string::npos) << page << " points into ../shared, which is not in a clone";
    // The rendezvous store is replica's locked store; c10d's TCPStore is named only to say so.
    for (size_t at = text.find("TCPStore"); at != std::string::npos; at = text.find("TCPStore", at + 1)) {
      const std::string before = text.substr(at >= 40 ? at - 40 : 0, std::min<size_t>(at, 40));
      EXPECT_TRUE(before.find("not c10d") != std::string::npos || before.find("instead of") != std::string::npos)
          << page << ": ..." << text.substr(at >= 40 ? at - 40 : 0, 120);
    }
  }
}
