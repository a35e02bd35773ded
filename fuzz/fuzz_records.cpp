// JSON Lines and CSV training records (replica/data/records.h). Input byte 0 picks the
// format (even: .jsonl, odd: .csv); the rest is the file.
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/data/records.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string path =
      replica::fuzz::write_file(data[0] % 2 ? "records.csv" : "records.jsonl", data + 1, size - 1);
  try {
    (void)replica::data::read_records(path);
  } catch (const replica::Error& e) {
    replica::fuzz::check_message(e);
  }
  return 0;
}
