// The YAML run configuration (replica/io/config.h parse_config): anything but a
// replica::Error escaping is a bug, as is a config that validates but cannot be written back.
#include "replica/core/error.h"
#include "replica/io/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto config = replica::io::parse_config(text, "fuzz.yaml");
    (void)replica::io::to_yaml(config);
  } catch (const replica::Error&) {
  }
  return 0;
}
