// The YAML run configuration (replica/train/run_config.h parse_config, every task's key table
// and the DeepSpeed reader it applies): anything but a replica::Error escaping is a bug, as is a
// config that validates but cannot be written back, or whose config.yaml reads back as another run.
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/train/run_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  replica::train::RunConfig config;
  try {
    config = replica::train::parse_config(text, "fuzz.yaml");
  } catch (const replica::Error& e) {
    replica::fuzz::check_message(e);
    return 0;
  }
  // Valid: config.yaml (to_yaml) must read back to the same run (run_config.h: equality
  // compares every key).
  const std::string yaml = replica::train::to_yaml(config);
  (void)replica::train::training_params_json(config);
  try {
    if (replica::train::parse_config(yaml, "config.yaml") != config) {
      std::fprintf(stderr, "config.yaml reads back as another run:\n%s\n", yaml.c_str());
      __builtin_trap();
    }
  } catch (const replica::Error& e) {
    std::fprintf(stderr, "config.yaml of a valid config is refused: %s\n%s\n", e.what(), yaml.c_str());
    __builtin_trap();
  }
  return 0;
}
