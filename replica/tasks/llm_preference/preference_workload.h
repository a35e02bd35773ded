// The workload of task llm's alignment trainers (params.trainer dpo | orpo | reward); see
// preference.h for the data and the losses.
#pragma once

#include "replica/models/llama.h"
#include "replica/tasks/llm_preference/preference.h"
#include "replica/train/workload.h"

#include <memory>

namespace replica::tasks {

// What can be refused before workers start, beyond llm-sft's checks: model_ref outside DPO or
// not a directory, dpo_beta <= 0.
void check_preference_config(const train::RunConfig& config);

// A batch for the model: on the context's device, with what the model takes from its host copy
// instead of asking the device (models::BatchFacts: the ids checked against vocab_size, an
// out-of-range id named as "llm preference batch ids: token id X is out of range for
// vocab_size V"; the layout of the padding segments).
struct DeviceSequenceBatch {
  SequenceBatch batch;
  models::BatchFacts facts;
};
DeviceSequenceBatch to_device(const SequenceBatch& host, int64_t vocab_size, const train::WorkloadContext& context);

std::unique_ptr<train::Workload> make_preference_workload(const train::RunConfig& config,
                                                          const train::WorkloadContext& context);

}  // namespace replica::tasks
