// The task -> workload table.
#include "replica/train/workload.h"

#include "replica/core/error.h"
#include "replica/train/image_classification.h"
#include "replica/train/llm_sft.h"
#include "replica/train/two_tower.h"

namespace replica::train {

std::unique_ptr<Workload> make_workload(const io::RunConfig& config, std::shared_ptr<dist::ProcessGroup> pg) {
  if (config.task == "image-classification") return make_image_classification(config, std::move(pg));
  if (config.task == "llm-sft") return make_llm_sft(config);
  if (config.task == "two-tower") return make_two_tower(config, std::move(pg));
  fail("task '{}' is not available in this build yet (available: image-classification, llm-sft, two-tower)",
       config.task);
}

void check_workload_config(const io::RunConfig& config) {
  if (config.task == "llm-sft") check_llm_sft_config(config);
  if (config.task == "two-tower") check_two_tower_config(config);
}

}  // namespace replica::train
