// Checkpoints: round trip of every part, rotation by save_total_limit, temporary
// directories ignored, and a corrupt newest checkpoint skipped in favour of the previous one.
#include "replica/train/checkpoint.h"

#include "replica/core/error.h"
#include "replica/io/files.h"
#include "replica/io/safetensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using replica::train::Checkpoint;
using replica::train::TrainerState;

namespace {

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "replica-ckpt-test-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // A checkpoint whose tensors depend on `step`, so checkpoints can be told apart.
  static Checkpoint make(int64_t step) {
    Checkpoint c;
    c.state.global_step = step;
    c.state.epoch = step / 7;
    c.state.micro_step = step * 3 + 1;
    c.state.world_size = 2;
    c.state.seed = 1234;
    c.state.log_history = nlohmann::json::array({{{"step", step}, {"loss", 0.5}}});
    torch::manual_seed(static_cast<uint64_t>(step));
    c.model = {{"layers.0.weight", torch::randn({4, 3})},
               {"layers.0.bias", torch::randn({4})},
               {"layers.2.weight", torch::randn({2, 4}, torch::kDouble)}};
    c.optimizer = {{"layers.0.weight.exp_avg", torch::randn({4, 3})},
                   {"layers.0.weight.step", torch::tensor(step, torch::kLong)}};
    c.rng = {{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
    return c;
  }

  std::string project() const { return dir_.string(); }
  std::string ckpt_dir(int64_t step) const { return (dir_ / ("checkpoint-" + std::to_string(step))).string(); }

  fs::path dir_;
};

void expect_same_tensors(const replica::io::NamedTensors& a, const replica::io::NamedTensors& b) {
  ASSERT_EQ(a.size(), b.size());
  std::map<std::string, torch::Tensor> by_name(b.begin(), b.end());
  for (const auto& [name, t] : a) {
    auto it = by_name.find(name);
    ASSERT_NE(it, by_name.end()) << name;
    EXPECT_EQ(t.scalar_type(), it->second.scalar_type()) << name;
    EXPECT_EQ(t.sizes(), it->second.sizes()) << name;
    EXPECT_TRUE(torch::equal(t, it->second)) << name;
  }
}

TEST_F(CheckpointTest, RoundTripKeepsEveryPart) {
  const Checkpoint saved = make(30);
  const std::string where = replica::train::save_checkpoint(project(), saved, 0);
  EXPECT_EQ(fs::path(where), fs::path(ckpt_dir(30)));
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "rng_state.safetensors", "trainer_state.json"}) {
    EXPECT_TRUE(fs::is_regular_file(fs::path(where) / f)) << f;
  }

  const Checkpoint loaded = replica::train::load_checkpoint(where);
  EXPECT_EQ(fs::path(loaded.dir), fs::path(where));
  EXPECT_EQ(loaded.state.global_step, 30);
  EXPECT_EQ(loaded.state.epoch, 30 / 7);
  EXPECT_EQ(loaded.state.micro_step, 91);
  EXPECT_EQ(loaded.state.world_size, 2);
  EXPECT_EQ(loaded.state.seed, 1234);
  EXPECT_EQ(loaded.state.log_history, saved.state.log_history);
  expect_same_tensors(saved.model, loaded.model);
  expect_same_tensors(saved.optimizer, loaded.optimizer);
  expect_same_tensors(saved.rng, loaded.rng);

  // The RNG state restores the generator: same draws after set_state.
  auto gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(loaded.rng[0].second);
  const auto a = torch::rand({5});
  gen.set_state(saved.rng[0].second);
  const auto b = torch::rand({5});
  EXPECT_TRUE(torch::equal(a, b));

  // trainer_state.json is plain JSON a human (or HF tooling) can read.
  std::ifstream in(fs::path(where) / "trainer_state.json");
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("global_step").get<int64_t>(), 30);
  EXPECT_EQ(j.at("world_size").get<int>(), 2);

  // No temporary directory is left behind.
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
}

TEST_F(CheckpointTest, TrainerStateRejectsMissingFieldsAndNegativeCounters) {
  TrainerState s;
  s.global_step = 5;
  const auto ok = TrainerState::from_json(s.to_json(), "x");
  EXPECT_EQ(ok.global_step, 5);
  auto j = s.to_json();
  j.erase("micro_step");
  EXPECT_THROW(TrainerState::from_json(j, "x"), replica::Error);
  j = s.to_json();
  j["global_step"] = -1;
  EXPECT_THROW(TrainerState::from_json(j, "x"), replica::Error);
  j = s.to_json();
  j["world_size"] = "two";
  EXPECT_THROW(TrainerState::from_json(j, "x"), replica::Error);
}

TEST_F(CheckpointTest, SaveTotalLimitKeepsTheNewest) {
  for (int64_t step : {5, 10, 15, 20, 25}) replica::train::save_checkpoint(project(), make(step), 2);
  EXPECT_EQ(replica::train::list_checkpoints(project()),
            (std::vector<std::string>{ckpt_dir(25), ckpt_dir(20)}));
  EXPECT_FALSE(fs::exists(ckpt_dir(15)));
  EXPECT_FALSE(fs::exists(ckpt_dir(5)));
  // The kept ones are whole.
  EXPECT_EQ(replica::train::load_checkpoint(ckpt_dir(20)).state.global_step, 20);

  // save_total_limit 1: only the newest; <= 0: all of them.
  replica::train::save_checkpoint(project(), make(30), 1);
  EXPECT_EQ(replica::train::list_checkpoints(project()), (std::vector<std::string>{ckpt_dir(30)}));
  replica::train::save_checkpoint(project(), make(35), 0);
  replica::train::save_checkpoint(project(), make(40), -1);
  EXPECT_EQ(replica::train::list_checkpoints(project()).size(), 3u);
}

TEST_F(CheckpointTest, ListingIsNumericNewestFirstAndIgnoresOtherEntries) {
  for (int64_t step : {9, 10, 100, 2}) replica::train::save_checkpoint(project(), make(step), 0);
  // Things that are not checkpoints.
  fs::create_directories(dir_ / "checkpoint-abc");
  fs::create_directories(dir_ / "final");
  fs::create_directories(dir_ / "checkpoint-7-old");
  std::ofstream(dir_ / "checkpoint-500") << "a file, not a directory";
  EXPECT_EQ(replica::train::list_checkpoints(project()),
            (std::vector<std::string>{ckpt_dir(100), ckpt_dir(10), ckpt_dir(9), ckpt_dir(2)}));
  EXPECT_TRUE(replica::train::list_checkpoints((dir_ / "missing").string()).empty());
}

// A symbolic link named like the newest checkpoint (here to a whole checkpoint of another
// project) is not replica's: rotation with save_total_limit 1 once took it for the newest and
// deleted every real checkpoint. Now it is neither listed, resumed from, rotated nor followed,
// and neither is a directory of the user's without replica's completion marker.
TEST_F(CheckpointTest, RotationAndResumeIgnoreASymlinkAndADirectoryReplicaDidNotWrite) {
  const fs::path elsewhere = dir_ / "elsewhere";
  replica::train::save_checkpoint(elsewhere.string(), make(5), 0);
  fs::create_directories(dir_ / "project");
  const std::string project = (dir_ / "project").string();
  const auto at = [&](int64_t step) { return (dir_ / "project" / ("checkpoint-" + std::to_string(step))).string(); };
  replica::train::save_checkpoint(project, make(10), 0);
  replica::train::save_checkpoint(project, make(20), 0);
  fs::create_directory_symlink(elsewhere / "checkpoint-5", dir_ / "project" / "checkpoint-999");
  fs::create_directories(dir_ / "project" / "checkpoint-500");
  std::ofstream(dir_ / "project" / "checkpoint-500" / "notes.txt") << "mine\n";

  EXPECT_EQ(replica::train::list_checkpoints(project), (std::vector<std::string>{at(20), at(10)}));
  auto latest = replica::train::latest_checkpoint(project);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->state.global_step, 20);

  replica::train::save_checkpoint(project, make(30), 1);
  EXPECT_EQ(replica::train::list_checkpoints(project), (std::vector<std::string>{at(30)}));
  EXPECT_EQ(replica::train::load_checkpoint(at(30)).state.global_step, 30);
  EXPECT_TRUE(fs::is_symlink(dir_ / "project" / "checkpoint-999"));
  EXPECT_EQ(replica::train::load_checkpoint((elsewhere / "checkpoint-5").string()).state.global_step, 5);
  EXPECT_TRUE(fs::exists(dir_ / "project" / "checkpoint-500" / "notes.txt"));

  // A save of a step whose name is held by something else is refused; nothing is replaced.
  fs::create_directory_symlink(elsewhere / "checkpoint-5", dir_ / "project" / "checkpoint-40");
  try {
    replica::train::save_checkpoint(project, make(40), 1);
    FAIL() << "saved over a symbolic link";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot save " + at(40) + ": that name is taken by a symbolic link"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(fs::is_symlink(dir_ / "project" / "checkpoint-40"));
  EXPECT_EQ(replica::train::load_checkpoint((elsewhere / "checkpoint-5").string()).state.global_step, 5);
  EXPECT_EQ(replica::train::list_checkpoints(project), (std::vector<std::string>{at(30)}));
}

TEST_F(CheckpointTest, TemporaryCheckpointDirectoryIsIgnored) {
  replica::train::save_checkpoint(project(), make(10), 0);
  // What a crash in the middle of saving checkpoint-20 leaves behind.
  const fs::path tmp = dir_ / ".checkpoint-20.tmp-4242";
  fs::create_directories(tmp);
  std::ofstream(tmp / "model.safetensors") << "partial";
  EXPECT_EQ(replica::train::list_checkpoints(project()), (std::vector<std::string>{ckpt_dir(10)}));
  std::vector<std::string> skipped;
  auto latest = replica::train::latest_checkpoint(project(), &skipped);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->state.global_step, 10);
  EXPECT_TRUE(skipped.empty());

  // Rotation never counts (or deletes) the temporary directory as a checkpoint... and a later
  // save of the same step by this process is not confused by a stale temporary of another pid.
  replica::train::save_checkpoint(project(), make(20), 1);
  EXPECT_EQ(replica::train::list_checkpoints(project()), (std::vector<std::string>{ckpt_dir(20)}));
  EXPECT_EQ(replica::train::load_checkpoint(ckpt_dir(20)).state.global_step, 20);
}

TEST_F(CheckpointTest, LatestSkipsATruncatedModelFile) {
  replica::train::save_checkpoint(project(), make(10), 0);
  replica::train::save_checkpoint(project(), make(20), 0);
  const fs::path model = fs::path(ckpt_dir(20)) / "model.safetensors";
  fs::resize_file(model, fs::file_size(model) / 2);

  EXPECT_THROW(replica::train::load_checkpoint(ckpt_dir(20)), replica::Error);
  std::vector<std::string> skipped;
  auto latest = replica::train::latest_checkpoint(project(), &skipped);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->state.global_step, 10);
  EXPECT_EQ(fs::path(latest->dir), fs::path(ckpt_dir(10)));
  expect_same_tensors(make(10).model, latest->model);
  EXPECT_EQ(skipped, (std::vector<std::string>{ckpt_dir(20)}));
}

TEST_F(CheckpointTest, LatestSkipsGarbageTrainerState) {
  replica::train::save_checkpoint(project(), make(10), 0);
  replica::train::save_checkpoint(project(), make(20), 0);
  std::ofstream(fs::path(ckpt_dir(20)) / "trainer_state.json", std::ios::trunc) << "{\"global_step\": 20, garbage";

  try {
    replica::train::load_checkpoint(ckpt_dir(20));
    FAIL() << "no error";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint-20"), std::string::npos) << e.what();
  }
  std::vector<std::string> skipped;
  auto latest = replica::train::latest_checkpoint(project(), &skipped);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->state.global_step, 10);
  EXPECT_EQ(skipped, (std::vector<std::string>{ckpt_dir(20)}));
}

TEST_F(CheckpointTest, LatestSkipsACheckpointWithoutTrainerState) {
  replica::train::save_checkpoint(project(), make(10), 0);
  replica::train::save_checkpoint(project(), make(20), 0);
  fs::remove(fs::path(ckpt_dir(20)) / "trainer_state.json");
  std::vector<std::string> skipped;
  auto latest = replica::train::latest_checkpoint(project(), &skipped);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->state.global_step, 10);
  EXPECT_EQ(skipped, (std::vector<std::string>{ckpt_dir(20)}));
}

TEST_F(CheckpointTest, NoUsableCheckpointGivesNulloptAndNamesThemAll) {
  EXPECT_FALSE(replica::train::latest_checkpoint(project()).has_value());  // empty project
  replica::train::save_checkpoint(project(), make(10), 0);
  replica::train::save_checkpoint(project(), make(20), 0);
  std::ofstream(fs::path(ckpt_dir(10)) / "optimizer.safetensors", std::ios::trunc) << "xx";
  std::ofstream(fs::path(ckpt_dir(20)) / "trainer_state.json", std::ios::trunc) << "[]";
  std::vector<std::string> skipped;
  EXPECT_FALSE(replica::train::latest_checkpoint(project(), &skipped).has_value());
  EXPECT_EQ(skipped, (std::vector<std::string>{ckpt_dir(20), ckpt_dir(10)}));
}

// checkpoint.h: "corrupt ones are skipped with a warning on stderr" naming the directory.
TEST_F(CheckpointTest, SkippedCheckpointIsReportedOnStderr) {
  replica::train::save_checkpoint(project(), make(10), 0);
  replica::train::save_checkpoint(project(), make(20), 0);
  fs::resize_file(fs::path(ckpt_dir(20)) / "model.safetensors", 10);

  const fs::path capture = dir_ / "stderr.txt";
  fflush(stderr);
  const int saved = dup(2);
  FILE* f = fopen(capture.c_str(), "w");
  ASSERT_NE(f, nullptr);
  dup2(fileno(f), 2);
  auto latest = replica::train::latest_checkpoint(project());
  fflush(stderr);
  std::cout.flush();
  dup2(saved, 2);
  close(saved);
  fclose(f);

  ASSERT_TRUE(latest.has_value());
  std::ifstream in(capture);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("checkpoint-20"), std::string::npos)
      << "the warning about the skipped checkpoint did not reach stderr; stderr was: '" << text << "'";
}

TEST_F(CheckpointTest, OneFlippedByteInTheNewestModelFileFallsBackToThePreviousCheckpoint) {
  replica::train::save_checkpoint(project(), make(10), 0);
  replica::train::save_checkpoint(project(), make(20), 0);
  EXPECT_TRUE(fs::exists(fs::path(ckpt_dir(20)) / "checksums.sha256"));
  // One byte in the tensor data: the file still parses as safetensors, only the checksum
  // can tell.
  const fs::path model = fs::path(ckpt_dir(20)) / "model.safetensors";
  {
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    f.seekp(-3, std::ios::end);
    c = static_cast<char>(c ^ 0x01);
    f.write(&c, 1);
  }
  EXPECT_NO_THROW(replica::io::load_safetensors(model.string()));
  try {
    replica::train::load_checkpoint(ckpt_dir(20));
    FAIL() << "a corrupted checkpoint must not load";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint-20/model.safetensors: SHA-256 does not match"), std::string::npos)
        << e.what();
  }
  std::vector<std::string> skipped;
  auto latest = replica::train::latest_checkpoint(project(), &skipped);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->state.global_step, 10);
  expect_same_tensors(make(10).model, latest->model);
  EXPECT_EQ(skipped, (std::vector<std::string>{ckpt_dir(20)}));
}

TEST_F(CheckpointTest, ChecksumManifestListsEveryFileAndAMissingOneIsNamed) {
  replica::train::save_checkpoint(project(), make(10), 0);
  std::ifstream in(fs::path(ckpt_dir(10)) / "checksums.sha256");
  const std::string manifest((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* name : {"model.safetensors", "optimizer.safetensors", "rng_state.safetensors", "trainer_state.json"}) {
    EXPECT_NE(manifest.find(std::string("  ") + name + "\n"), std::string::npos) << name << " in " << manifest;
  }
  EXPECT_EQ(replica::io::sha256_file((fs::path(ckpt_dir(10)) / "trainer_state.json").string()).size(), 64u);
  fs::remove(fs::path(ckpt_dir(10)) / "rng_state.safetensors");
  try {
    replica::train::load_checkpoint(ckpt_dir(10));
    FAIL() << "a checkpoint missing a listed file must not load";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rng_state.safetensors: missing"), std::string::npos) << e.what();
  }
}

// A write that fails midway (the disk fills up) is injected with RLIMIT_FSIZE: writes past
// the limit fail with EFBIG, as they would with ENOSPC, without needing a mount.
TEST_F(CheckpointTest, AFailedSaveLeavesThePreviousCheckpointIntactAndSaysSo) {
  replica::train::save_checkpoint(project(), make(10), 0);
  Checkpoint big = make(20);
  big.model.emplace_back("huge", torch::zeros({1 << 20}));  // 4 MiB
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto old_handler = signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    replica::train::save_checkpoint(project(), big, 0);
  } catch (const replica::Error& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, old_handler);
  EXPECT_NE(message.find("could not save " + ckpt_dir(20)), std::string::npos) << message;
  EXPECT_NE(message.find("the previous checkpoint " + ckpt_dir(10) + " is intact"), std::string::npos) << message;
  // Nothing half-written is left behind, and the previous checkpoint still verifies.
  EXPECT_EQ(replica::train::list_checkpoints(project()), (std::vector<std::string>{ckpt_dir(10)}));
  for (const auto& entry : fs::directory_iterator(project())) {
    EXPECT_EQ(entry.path().filename().string().find(".checkpoint-"), std::string::npos) << entry.path();
  }
  auto latest = replica::train::latest_checkpoint(project());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->state.global_step, 10);
}

}  // namespace
