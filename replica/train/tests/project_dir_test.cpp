// The project directory (train/project_dir.h): `--overwrite` removes only what replica wrote
// (never a symbolic link, what it points to, or a user's directory under a checkpoint name),
// and what a killed save left behind is cleaned when the next run starts, without touching a
// save still under way in a live process. Plus one whole run of the real `replica` program
// in a project holding both.
#include "replica/train/project_dir.h"

#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

namespace fs = std::filesystem;

namespace {

using replica::testing::read_file;

class ProjectDir : public replica::testing::ScratchDirTest {
 protected:
  ProjectDir() : ScratchDirTest("replica-project-dir") {}

  fs::path project() const { return dir_ / "project"; }

  // A directory as a save leaves it: trainer_state.json inside.
  static void make_checkpoint(const fs::path& dir) {
    fs::create_directories(dir);
    std::ofstream(dir / "trainer_state.json") << "{}\n";
  }

  std::set<std::string> names() const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(project())) out.insert(e.path().filename().string());
    return out;
  }
};

// A PID no process has: above the kernel's largest possible pid_max (2^22). (A child that has
// exited would do, but its PID may be handed to another process before the check.)
pid_t dead_pid() { return (1 << 22) + 1; }

TEST_F(ProjectDir, OverwriteRemovesOnlyWhatReplicaWroteAndFollowsNoLink) {
  const fs::path outside = dir_ / "outside";
  fs::create_directories(outside / "data");
  std::ofstream(outside / "data" / "train.jsonl") << "{}\n";
  std::ofstream(outside / "events.txt") << "mine\n";
  make_checkpoint(outside / "checkpoint-3");

  fs::create_directories(project());
  // replica's own outputs.
  std::ofstream(project() / "config.yaml") << "task: x\n";
  std::ofstream(project() / "metrics.jsonl") << "{}\n";
  std::ofstream(project() / "events.out.tfevents.1.host") << "x";
  make_checkpoint(project() / "checkpoint-5");
  fs::create_directories(project() / "final");
  std::ofstream(project() / "final" / "model.safetensors") << "x";
  // Named like outputs, but not replica's.
  fs::create_directories(project() / "checkpoint-6");  // no completion marker: the user's
  std::ofstream(project() / "checkpoint-6" / "notes.txt") << "mine\n";
  fs::create_directory_symlink(outside / "checkpoint-3", project() / "checkpoint-999");
  fs::create_directory_symlink(outside / "data", project() / "merged");
  fs::create_symlink(outside / "events.txt", project() / "events.out.tfevents.2.host");
  fs::create_directories(project() / "training_params.json");  // a directory where a file belongs
  std::ofstream(project() / "notes.txt") << "mine\n";

  std::vector<std::string> odd;
  for (const auto& l : replica::train::lookalikes(project())) odd.push_back(l.path.filename().string() + ": " + l.why);
  std::sort(odd.begin(), odd.end());
  EXPECT_EQ(odd, (std::vector<std::string>{"checkpoint-6: no trainer_state.json or checksums.sha256 in it",
                                           "checkpoint-999: a symbolic link",
                                           "events.out.tfevents.2.host: a symbolic link",
                                           "merged: a symbolic link",
                                           "training_params.json: a directory where replica writes a file"}));

  EXPECT_EQ(replica::train::remove_run_outputs(project()), 5u);
  EXPECT_EQ(names(), (std::set<std::string>{"checkpoint-6", "checkpoint-999", "events.out.tfevents.2.host", "merged",
                                            "notes.txt", "training_params.json"}));
  EXPECT_EQ(read_file(project() / "checkpoint-6" / "notes.txt"), "mine\n");
  EXPECT_TRUE(fs::is_symlink(project() / "checkpoint-999"));
  EXPECT_TRUE(fs::exists(outside / "checkpoint-3" / "trainer_state.json"));
  EXPECT_EQ(read_file(outside / "data" / "train.jsonl"), "{}\n");
  EXPECT_EQ(read_file(outside / "events.txt"), "mine\n");
}

TEST_F(ProjectDir, WhatAKilledSaveLeftIsCleanedUnlessItsProcessIsAlive) {
  const pid_t dead = dead_pid();
  const pid_t alive = getppid();  // the test runner's parent: alive, and not this process
  const auto name = [](const char* format, long pid) { return std::string(format) + std::to_string(pid); };
  fs::create_directories(project());
  make_checkpoint(project() / "checkpoint-10");
  fs::create_directories(project() / name(".checkpoint-20.tmp-", dead));  // a save killed midway
  std::ofstream(project() / name(".checkpoint-20.tmp-", dead) / "model.safetensors") << "partial";
  fs::create_directories(project() / name(".checkpoint-30.tmp-", alive));  // a save under way
  fs::create_directories(project() / name(".checkpoint-10.tmp-", getpid()));  // this PID's earlier life
  // Killed between moving checkpoint-40 aside and renaming its replacement in: the only copy.
  make_checkpoint(project() / name(".checkpoint-40.old-", dead));
  // Killed while removing the moved-aside copy after the replacement was in place.
  make_checkpoint(project() / "checkpoint-50");
  fs::create_directories(project() / name(".checkpoint-50.old-", dead));
  fs::create_directories(project() / ".zero-60");  // ZeRO-3 shards being gathered
  std::ofstream(project() / name("config.yaml.tmp.", dead)) << "half";
  std::ofstream(project() / "notes.tmp.1") << "mine\n";  // not a name replica writes

  auto done = replica::train::clean_stale_staging(project());
  std::sort(done.begin(), done.end());
  EXPECT_EQ(done, (std::vector<std::string>{name(".checkpoint-10.tmp-", getpid()) + " removed",
                                            name(".checkpoint-20.tmp-", dead) + " removed",
                                            name(".checkpoint-40.old-", dead) + " restored as checkpoint-40",
                                            name(".checkpoint-50.old-", dead) + " removed", ".zero-60 removed",
                                            name("config.yaml.tmp.", dead) + " removed"}));
  EXPECT_EQ(names(), (std::set<std::string>{"checkpoint-10", "checkpoint-40", "checkpoint-50",
                                            name(".checkpoint-30.tmp-", alive), "notes.tmp.1"}));
  EXPECT_TRUE(replica::train::is_replica_checkpoint(project() / "checkpoint-40"));
}

// A whole run in a project holding a symbolic link checkpoint-999 (to a whole checkpoint of
// another project) and the staging directory of a killed save: it resumes from its own newest
// checkpoint, rotates with save_total_limit 1 without touching the link or its target, warns
// naming the link, and removes the stale staging directory.
TEST_F(ProjectDir, ARunResumesFromItsOwnCheckpointAndLeavesASymlinkAlone) {
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  const std::string data = "/usr/share/datasets/fashion-mnist";
  ASSERT_TRUE(fs::exists(fs::path(data) / "train-labels-idx1-ubyte.gz") ||
              fs::exists(fs::path(data) / "train-labels-idx1-ubyte"));
  std::ofstream(dir_ / "run.yaml") << "task: image-classification\nmodel: mlp\nlog: jsonl\ndata:\n  path: " << data
                                   << "\n  valid_split: null\nparams:\n  nproc_per_node: 1\n  batch_size: 16\n"
                                   << "  optimizer: sgd\n  lr: 0.01\n  seed: 7\n  threads_per_worker: 1\n"
                                   << "  checkpoint_every: 2\n  save_total_limit: 1\n  hidden_sizes: [16]\n";
  const auto run = [&](const fs::path& project, const char* steps) {
    return replica::testing::run_program(REPLICA_BIN, {"--config", (dir_ / "run.yaml").string(), "--project-name",
                                                       project.string(), "--max-steps", steps},
                                         {}, std::chrono::seconds(90));
  };
  const replica::testing::Result other = run(dir_ / "other", "2");
  ASSERT_EQ(other.exit_code, 0) << other;
  const replica::testing::Result first = run(project(), "2");
  ASSERT_EQ(first.exit_code, 0) << first;
  fs::create_directory_symlink(dir_ / "other" / "checkpoint-2", project() / "checkpoint-999");
  const std::string stale = ".checkpoint-4.tmp-" + std::to_string(dead_pid());
  fs::create_directories(project() / stale);

  const replica::testing::Result second = run(project(), "4");
  ASSERT_EQ(second.exit_code, 0) << second;
  EXPECT_NE(second.all().find("resuming from " + (project() / "checkpoint-2").string()), std::string::npos) << second;
  EXPECT_NE(second.all().find((project() / "checkpoint-999").string() +
                              ": a symbolic link, not written by replica; resume, checkpoint rotation and --overwrite "
                              "leave it alone"),
            std::string::npos)
      << second;
  EXPECT_NE(second.all().find(stale + " removed (left by a killed save)"), std::string::npos) << second;
  EXPECT_TRUE(replica::train::is_replica_checkpoint(project() / "checkpoint-4"));
  EXPECT_FALSE(fs::exists(project() / "checkpoint-2"));  // rotated: save_total_limit 1
  EXPECT_FALSE(fs::exists(project() / stale));
  EXPECT_TRUE(fs::is_symlink(project() / "checkpoint-999"));
  EXPECT_TRUE(fs::exists(dir_ / "other" / "checkpoint-2" / "model.safetensors"));
}

}  // namespace
