// DeepSpeed JSON configs (replica/train/deepspeed_config.h apply_deepspeed_config). Input byte
// 0: bits 0-1 pick the task (llm-sft, image-classification, two-tower); bit 2 reads the file
// through a YAML config that also sets some of the keys it may contradict (batch_size,
// mixed_precision, distributed_backend), else applies it as `replica llm --deepspeed` does.
// The rest is the JSON file. A file that applies must apply again to the same run (idempotent,
// deepspeed_config.h) and write back (config.yaml, training_params.json).
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/train/deepspeed_config.h"
#include "replica/train/run_config.h"

#include <fmt/format.h>

namespace {

using namespace replica::train;

const char* const kTasks[] = {"llm-sft", "image-classification", "two-tower", "image-classification"};

RunConfig through_yaml(const std::string& task, const std::string& ds_path) {
  // parse_config applies the DeepSpeed file before it checks paths, so the file is read even
  // though base_model / data.path do not exist here.
  const std::string yaml = fmt::format(
      "task: {}\nproject_name: p\ndata:\n  path: {}\nparams:\n  batch_size: 4\n  mixed_precision: bf16\n"
      "  distributed_backend: ddp\n  deepspeed: {}\n",
      task, replica::fuzz::scratch_dir(), ds_path);
  return parse_config(yaml, "fuzz.yaml");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string task = kTasks[data[0] & 3];
  const std::string path = replica::fuzz::write_file("ds_config.json", data + 1, size - 1);
  RunConfig config;
  try {
    if (data[0] & 4) {
      config = through_yaml(task, path);
    } else {
      config = default_config(task);
      config.params.deepspeed = path;
      apply_deepspeed_config(config);
    }
  } catch (const replica::Error& e) {
    replica::fuzz::check_message(e);
    return 0;
  }
  RunConfig again = config;
  try {
    apply_deepspeed_config(again);
  } catch (const replica::Error& e) {
    std::fprintf(stderr, "a DeepSpeed config that applied is refused the second time: %s\n", e.what());
    __builtin_trap();
  }
  if (again != config) {
    std::fprintf(stderr, "a DeepSpeed config applied twice gives another run\n");
    __builtin_trap();
  }
  (void)to_yaml(config);
  (void)training_params_json(config);
  return 0;
}
