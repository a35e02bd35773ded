// tokenizer.json (replica/text/tokenizer.h): the model, normalizer, pre-tokenizer,
// post-processor and decoder sections; a tokenizer that loads must also encode and decode.
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string json(reinterpret_cast<const char*>(data), size);
  try {
    const auto tokenizer = replica::text::Tokenizer::from_json_string(json, "fuzz/tokenizer.json");
    const auto ids = tokenizer.encode("Hello, world! 123 h\xc3\xa9llo \xf0\x9f\x99\x82 <s>", true);
    (void)tokenizer.decode(ids, false);
    (void)tokenizer.decode({0, 1, 2, -1, 1 << 30}, true);
  } catch (const replica::Error& e) {
    replica::fuzz::check_message(e);
  }
  return 0;
}
