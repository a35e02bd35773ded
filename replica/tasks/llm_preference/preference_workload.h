// The workload of task llm's alignment trainers (params.trainer dpo | orpo | reward); see
// preference.h for the data and the losses.
#pragma once

#include "replica/train/workload.h"

#include <memory>

namespace replica::tasks {

// What can be refused before workers start, beyond llm-sft's checks: model_ref outside DPO or
// not a directory, dpo_beta <= 0.
void check_preference_config(const train::RunConfig& config);

std::unique_ptr<train::Workload> make_preference_workload(const train::RunConfig& config,
                                                          const train::WorkloadContext& context);

}  // namespace replica::tasks
