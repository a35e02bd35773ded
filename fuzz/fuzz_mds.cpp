// MDS data sets (replica/data/mds.h MdsDataset): index.json, shard files and zstd shards, every
// count and size checked against the files before anything is allocated. Input bytes 0-1: the
// length of index.json (little-endian, capped by the input); the rest is the shard, written as
// both shard.00000.mds and shard.00000.mds.zstd (whichever the index names). A data set that
// opens has its first samples read and decoded.
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/data/mds.h"

#include <algorithm>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t index = std::min<size_t>(data[0] | size_t{data[1]} << 8, size - 2);
  const uint8_t* shard = data + 2 + index;
  const size_t shard_size = size - 2 - index;
  replica::fuzz::write_file("index.json", data + 2, index);
  replica::fuzz::write_file("shard.00000.mds", shard, shard_size);
  replica::fuzz::write_file("shard.00000.mds.zstd", shard, shard_size);
  try {
    const replica::data::MdsDataset dataset(replica::fuzz::scratch_dir());
    const int64_t n = std::min<int64_t>(dataset.size(), 8);
    for (int64_t i = 0; i < n; ++i) (void)dataset.get(i);
    if (n > 0 && dataset.size() > n) (void)dataset.get(dataset.size() - 1);
  } catch (const replica::Error& e) {
    replica::fuzz::check_message(e);
  }
  return 0;
}
