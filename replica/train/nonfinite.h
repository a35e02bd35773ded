// Non-finite numbers in training: a NaN or Inf loss on some worker, a non-finite global
// gradient norm, weights that are about to be saved.
//
// Why in one place: every rank must take the same decision. A rank that stops while the others
// go on into the step's next collective would leave them waiting until the collective timeout,
// so each decision is made from a value every rank holds after the same all-reduce: one
// number per optimizer step (fp16 adds its flag to the loss scaler's all-reduce instead), and
// only when something is wrong, an all-gather of each rank's few words about it so that every
// rank writes the same message.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace replica::distributed {
class ProcessGroup;
}

namespace replica::train {

// This worker's losses of one optimizer step, one per micro-batch (as backpropagated).
class StepLosses {
 public:
  void add(double loss);
  bool finite() const { return first_bad_ < 0; }
  // "nan in micro-batch 2 of 4" (the first non-finite one); "" when finite().
  std::string describe() const;

 private:
  int64_t count_ = 0;
  int64_t first_bad_ = -1;  // index of the first non-finite micro-batch loss
  double bad_value_ = 0;
};

// Whether some rank's loss of this step was not finite, and which: "rank 1: nan in micro-batch
// 2 of 4" ("; "-separated, the first few ranks). The same on every rank. Collective: one
// all-reduce of one number; the all-gather of the descriptions only when one is not finite.
struct NonfiniteLosses {
  bool found = false;
  std::string where;
};
NonfiniteLosses agree_on_losses(const StepLosses& mine, distributed::ProcessGroup& pg);

// The text of a stop: "step 7: the training loss is not finite (rank 1: nan in micro-batch 2
// of 4); ...what was kept and what to do". `read_late`: the step's numbers were read after its
// update was applied (Note [the step's reads, a step late] in trainer.cpp), which is not saved.
std::string nonfinite_stop_message(int64_t step, const std::string& what, bool read_late = false);

// Before anything is saved (a checkpoint, final/): a replica::Error on every rank when any
// rank's `params` (what the optimizer steps: the trainable weights or this rank's shards of
// them, named by `names`) hold a NaN or Inf, naming the step, the rank, the tensor and
// `saving` ("checkpoint-12", "final/"). Collective, like agree_on_losses.
void require_finite_weights(const std::vector<torch::Tensor>& params, const std::vector<std::string>& names,
                            distributed::ProcessGroup& pg, int64_t step, const std::string& saving);

}  // namespace replica::train
