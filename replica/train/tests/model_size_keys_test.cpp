// The keys that size replica's own models (image-classification's MLP, the two-tower model)
// are bounded where the keys are checked (models/mlp.h: Note [model size bounds]): a mistyped
// width is one line naming the key, not a request for terabytes when the model is built.
#include "replica/testing/program_runner.h"
#include "replica/train/run_config.h"
#include "replica/train/tests/parse_error.h"

#include <gtest/gtest.h>

#include <string>

namespace {

using replica::train::testing::parse_error_of;

class ModelSizeKeys : public replica::testing::ScratchDirTest {
 protected:
  ModelSizeKeys() : ScratchDirTest("replica-size-keys") {}
  // A config of `task` whose data.path exists; `params_lines` go on from line 6.
  std::string config(const std::string& task, const std::string& params_lines) const {
    return "task: " + task + "\nproject_name: out/run\ndata:\n  path: " + dir_.string() + "\nparams:\n" +
           params_lines;
  }
};

TEST_F(ModelSizeKeys, ImageClassificationHiddenSizesAreBounded) {
  EXPECT_EQ(parse_error_of(config("image-classification", "  hidden_sizes: [256, 2147483647]\n")),
            "run.yaml:6: key 'params.hidden_sizes' must list widths from 1 to 65536, got 2147483647");
}

TEST_F(ModelSizeKeys, TwoTowerHiddenSizesAndEmbeddingDimAreBounded) {
  EXPECT_EQ(parse_error_of(config("two-tower", "  hidden_sizes: [2147483647]\n")),
            "run.yaml:6: key 'params.hidden_sizes' must list widths from 1 to 65536, got 2147483647");
  EXPECT_EQ(parse_error_of(config("two-tower", "  embedding_dim: 4294967296\n")),
            "run.yaml:6: key 'params.embedding_dim' must be <= 65536, got 4294967296");
}

}  // namespace
