// The preference trainers' way to the device (to_device in preference_workload.h): the ids
// checked on the host copy, an out-of-range id named with the input and vocab_size (Note [token
// ids checked on the host] in models/llama.cpp), and the layout of the padding segments.
#include "replica/core/error.h"
#include "replica/tasks/llm_preference/preference.h"
#include "replica/tasks/llm_preference/preference_workload.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

using namespace replica::tasks;

TEST(PreferenceBatch, IdsAreCheckedAndPaddingLaidOutOnTheHostBeforeTheBatchMoves) {
  std::vector<ScoredSequence> seqs(2);
  seqs[0].ids = {1, 2, 3, 4};
  seqs[0].completion = {0, 0, 1, 1};
  seqs[1].ids = {5, 6};
  seqs[1].completion = {0, 1};
  replica::train::WorkloadContext context;
  const auto d = to_device(make_sequence_batch(seqs, /*pad_id=*/0), 10, context);
  EXPECT_TRUE(d.facts.ids_checked);
  // Row 0: one sequence of 4; row 1: 2 tokens, then 2 pads.
  EXPECT_EQ(d.facts.packed.offsets, (std::vector<int64_t>{0, 4, 6, 8}));
  EXPECT_TRUE(d.batch.ids.equal(make_sequence_batch(seqs, 0).ids));

  seqs[1].ids[0] = 12;
  try {
    to_device(make_sequence_batch(seqs, /*pad_id=*/0), 10, context);
    ADD_FAILURE() << "an id past vocab_size went through";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("llm preference batch ids: token id 12 is out of range for vocab_size 10"),
              std::string::npos)
        << e.what();
  }
}
