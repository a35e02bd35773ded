// Issue 36: `--help` says what the program does. Two ways it did not: `replica llm --help`
// printed the heading "Training (AutoTrain's LLMTrainingParams names and defaults):" with
// nothing under it, and `--checkpoint-every 0` promised "none but the last" checkpoint where a
// run writes none. Every command's help is read here as a reader reads it (every heading has
// entries under it), and the checkpoint key's help is held to what a run writes.
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

using replica::testing::Result;

std::string join(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.pop_back();
    out.push_back(line);
  }
  return out;
}

// A heading is a line at the left margin ending in ':' ("Options:", "Training:"); its entries
// are the indented lines right under it.
std::vector<std::string> empty_headings(const std::string& help) {
  const auto lines = lines_of(help);
  std::vector<std::string> empty;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    if (l.empty() || l[0] == ' ' || l.back() != ':') continue;
    const bool entry_follows = i + 1 < lines.size() && lines[i + 1].size() > 2 && lines[i + 1][0] == ' ' &&
                               lines[i + 1].find_first_not_of(' ') != std::string::npos;
    if (!entry_follows) empty.push_back(l);
  }
  return empty;
}

// The subcommands a CLI11 help lists under its "Subcommands:" heading (any case).
std::vector<std::string> subcommands_in(const std::string& help) {
  std::vector<std::string> out;
  bool inside = false;
  for (const auto& l : lines_of(help)) {
    if (!l.empty() && l[0] != ' ') {
      std::string lower = l;
      std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
      inside = lower == "subcommands:";
      continue;
    }
    if (inside && l.size() > 2 && l[0] == ' ') {
      std::istringstream words(l);
      std::string name;
      words >> name;
      out.push_back(name);
    }
  }
  return out;
}

Result help_of(const std::vector<std::string>& command) {
  std::vector<std::string> args = command;
  args.push_back("--help");
  return replica::testing::run_program(REPLICA_BIN, args);
}

TEST(HelpText, EveryHeadingOfEveryCommandsHelpHasEntries) {
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  // Every command `replica --help` lists, and theirs in turn; `replica llm` prints its own help,
  // whose usage names `llm init-demo`.
  std::vector<std::vector<std::string>> todo = {{}, {"llm", "init-demo"}};
  std::set<std::string> seen;
  for (size_t i = 0; i < todo.size(); ++i) {
    const auto command = todo[i];
    const Result r = help_of(command);
    const std::string shown = "replica " + join(command) + (command.empty() ? "" : " ") + "--help";
    ASSERT_EQ(r.exit_code, 0) << shown << "\n" << r;
    EXPECT_FALSE(r.out.empty()) << shown << " printed nothing on stdout";
    for (const auto& heading : empty_headings(r.out)) {
      ADD_FAILURE() << shown << ": the heading \"" << heading << "\" has no entries under it\n" << r.out;
    }
    seen.insert(join(command));
    for (const auto& sub : subcommands_in(r.out)) {
      auto next = command;
      next.push_back(sub);
      if (!seen.count(join(next))) todo.push_back(next);
    }
  }
  // The command table of README and docs/cli.md: each was read above.
  for (const std::string c : {"launch", "env", "bench", "bench allreduce", "llm", "llm init-demo", "tokenize",
                              "merge-adapter", "mds", "mds convert", "mds synthetic", "consolidate", "plot", "keys"}) {
    EXPECT_TRUE(seen.count(c)) << "replica " << c << " --help was not reached from replica --help";
  }
}

TEST(HelpText, EmptyHeadingsAreFound) {
  EXPECT_EQ(empty_headings("Usage: x\n\nOptions:\n  -h  help\nTraining:\nRun:\n  --a  b\n"),
            (std::vector<std::string>{"Training:"}));
  EXPECT_EQ(empty_headings("Data:\n  --x\nLast:\n"), (std::vector<std::string>{"Last:"}));
  EXPECT_EQ(subcommands_in("Usage: x\nSubcommands:\n  launch   Start\n  env      Print\n\nOther:\n  y\n"),
            (std::vector<std::string>{"launch", "env"}));
}

class HelpMatchesBehaviour : public replica::testing::ScratchDirTest {
 protected:
  HelpMatchesBehaviour() : ScratchDirTest("replica-help") {}

  // A 3-step MLP run on Fashion-MNIST with `flags`, into dir_/name; the checkpoints it left.
  std::vector<std::string> checkpoints_after(const std::string& name, const std::vector<std::string>& flags) {
    const fs::path cfg = dir_ / "run.yaml";
    std::ofstream(cfg) << "task: image-classification\nmodel: mlp\nproject_name: " << (dir_ / name).string()
                       << "\nlog: jsonl\ndata:\n  valid_split: null\nparams:\n  hidden_sizes: [16]\n"
                       << "  batch_size: 16\n  max_steps: 3\n  nproc_per_node: 1\n  threads_per_worker: 1\n";
    std::vector<std::string> args = {"--config", cfg.string()};
    args.insert(args.end(), flags.begin(), flags.end());
    const Result r = replica::testing::run_program(REPLICA_BIN, args);
    EXPECT_EQ(r.exit_code, 0) << r;
    EXPECT_TRUE(fs::exists(dir_ / name / "final" / "model.safetensors")) << name << ": no final model\n" << r;
    std::vector<std::string> found;
    if (!fs::is_directory(dir_ / name)) return found;
    for (const auto& e : fs::directory_iterator(dir_ / name)) {
      const std::string file = e.path().filename().string();
      if (file.rfind("checkpoint-", 0) == 0) found.push_back(file);
    }
    std::sort(found.begin(), found.end());
    return found;
  }
};

// The help of `--checkpoint-every` (from the key table, as in `replica keys` and docs/cli.md)
// and what a run writes: every N steps and at the end, and with 0 no checkpoint at all.
TEST_F(HelpMatchesBehaviour, CheckpointEverySaysWhatARunWrites) {
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  const Result keys = replica::testing::run_program(REPLICA_BIN, {"keys", "image-classification"});
  ASSERT_EQ(keys.exit_code, 0) << keys;
  std::string help;  // the flag's line and its continuation lines
  const auto lines = lines_of(keys.out);
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].rfind("  --checkpoint-every", 0) != 0) continue;
    help = lines[i];
    for (size_t j = i + 1; j < lines.size() && lines[j].rfind("   ", 0) == 0; ++j) help += " " + lines[j];
  }
  std::string words;  // the help with its wrapping undone
  std::istringstream in(help);
  for (std::string w; in >> w;) words += (words.empty() ? "" : " ") + w;
  EXPECT_NE(words.find("every N steps and one at the end"), std::string::npos) << words;
  EXPECT_NE(words.find("0: no checkpoints at all"), std::string::npos) << words;

  EXPECT_EQ(checkpoints_after("every0", {"--checkpoint-every", "0"}), std::vector<std::string>{});
  EXPECT_EQ(checkpoints_after("every2", {"--checkpoint-every", "2", "--save-total-limit", "0"}),
            (std::vector<std::string>{"checkpoint-2", "checkpoint-3"}));
}

}  // namespace
