// The task -> workload table.
#include "replica/train/workload.h"

#include "replica/core/error.h"
#include "replica/train/image_classification.h"
#include "replica/train/llm_sft.h"

namespace replica::train {

std::unique_ptr<Workload> make_workload(const io::RunConfig& config) {
  if (config.task == "image-classification") return make_image_classification(config);
  if (config.task == "llm-sft") return make_llm_sft(config);
  fail("task '{}' is not available in this build yet (available: image-classification, llm-sft)", config.task);
}

void check_workload_config(const io::RunConfig& config) {
  if (config.task == "llm-sft") check_llm_sft_config(config);
}

}  // namespace replica::train
