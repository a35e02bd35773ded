// safetensors files (replica/io/safetensors.h load_safetensors): header length, JSON header,
// dtypes, shapes and offsets against the data section.
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = replica::fuzz::write_file("model.safetensors", data, size);
  try {
    (void)replica::io::load_safetensors(path);
  } catch (const replica::Error& e) {
    replica::fuzz::check_message(e);
  }
  return 0;
}
