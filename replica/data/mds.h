// Mosaic Streaming's MDS shard format (version 2): a writer and a random-access reader.
//
// A dataset directory holds index.json and shard.NNNNN.mds files (shard.NNNNN.mds.zstd when
// compressed), laid out as mosaicml-streaming's MDSWriter writes them, so that either side can
// read what the other wrote:
//
// index.json
//   {"version": 2, "shards": [SHARD, ...]}, each SHARD:
//     "version": 2, "format": "mds",
//     "column_names":     columns, sorted by name (the order of the values in a sample),
//     "column_encodings": one per column: int8 int16 int32 int64 uint8 uint16 uint32 uint64
//                         int (int64) float32 float64 str bytes json ndarray[:DTYPE[:D0,D1,..]],
//     "column_sizes":     bytes of a fixed-size encoding, null for a variable-size one,
//     "compression":      null, "zstd" or "zstd:LEVEL",
//     "hashes": [], "size_limit": bytes after which the writer starts a new shard (or null),
//     "samples":          samples in this shard,
//     "raw_data": {"basename": "shard.00000.mds", "bytes": N, "hashes": {}},
//     "zip_data": null, or {"basename": "shard.00000.mds.zstd", "bytes": N, "hashes": {}}.
//
// shard.NNNNN.mds (all integers little-endian uint32)
//   num_samples | offsets[num_samples + 1] | the shard's config (the SHARD keys above that
//   describe columns and writer settings, as sorted JSON) | the samples.
//   offsets[i] is the byte position of sample i from the start of the file, offsets[n] the end.
//   A sample: one uint32 size per variable-size column (in column order), then every column's
//   bytes in column order. Encodings: integers and floats as their little-endian bytes; str,
//   json as UTF-8; bytes as they are; ndarray as mosaicml-streaming's NDArray: [dtype code: 1
//   byte, when the encoding names no dtype] [ndim << 2 | shape width code: 1 byte, then the
//   shape, when it names no shape] [values, C order].
//
// Reading is lazy: opening a dataset reads index.json only; a sample is read with one pread
// of its bytes, so a worker that asks only for its own indices reads only its share.
// A zstd shard is decompressed (and kept) the first time one of its samples is asked for.
// Every malformed input is a replica::Error naming the file (and sample or column). Hostile
// ones too: every count and size is checked against the files' lengths before anything is
// allocated (Note [MDS sizes are checked before they are used] in mds.cpp), a zstd shard
// never expands past index.json's raw_data.bytes, shard files are regular files only, and a
// basename that leads outside the data directory ('..', an absolute path, a symlink out) is
// refused.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace replica::data {

// One column value: integers (any int/uint encoding), floats (float32/float64), text or raw
// bytes (str, bytes, json), or a tensor (ndarray).
using MdsValue = std::variant<int64_t, double, std::string, torch::Tensor>;
using MdsSample = std::map<std::string, MdsValue>;

struct MdsColumn {
  std::string name;
  std::string encoding;
};

struct MdsWriterOptions {
  std::string compression;                 // "" (none), "zstd" or "zstd:LEVEL"
  std::optional<int64_t> size_limit = int64_t{1} << 26;  // bytes per shard; nullopt: one shard
};

class MdsWriter {
 public:
  // Creates `dir` if needed. Columns are stored sorted by name, as MDSWriter stores them.
  MdsWriter(std::string dir, std::vector<MdsColumn> columns, MdsWriterOptions options = {});
  ~MdsWriter();  // without finish() no index.json is written: an interrupted write is unreadable
  MdsWriter(const MdsWriter&) = delete;
  MdsWriter& operator=(const MdsWriter&) = delete;

  // Appends one sample; it must have a value of the right kind for every column.
  void write(const MdsSample& sample);
  // Writes the last shard and index.json.
  void finish();

 private:
  void flush_shard();
  std::string shard_config_json() const;

  std::string dir_;
  std::vector<MdsColumn> columns_;
  std::vector<std::optional<int64_t>> sizes_;
  MdsWriterOptions options_;
  std::vector<std::string> pending_;  // encoded samples of the shard being filled
  int64_t pending_bytes_ = 0;
  std::vector<std::string> shard_entries_;  // JSON of each finished shard
  bool finished_ = false;
};

class MdsDataset {
 public:
  // `path`: a directory holding index.json (or the index.json file itself).
  explicit MdsDataset(const std::string& path);

  int64_t size() const { return total_; }
  const std::vector<MdsColumn>& columns() const { return columns_; }
  bool has_column(const std::string& name) const;
  const std::string& path() const { return dir_; }

  // Sample `index` (0 <= index < size()), every column decoded. Thread-safe.
  MdsSample get(int64_t index) const;
  // One integer column of the given samples (an int or uint encoding), as int64 [N].
  torch::Tensor int_column(const std::string& column, const std::vector<int64_t>& indices) const;

 private:
  struct Shard {
    std::string raw_path, zip_path;
    int64_t samples = 0;
    int64_t first = 0;  // global index of its first sample
    bool compressed = false;
    // The shard's length (decompressed: raw_data.bytes) and its zstd file's length, both
    // checked against index.json and bounded when the data set is opened.
    uint64_t raw_bytes = 0, zip_bytes = 0;
    mutable std::shared_ptr<std::string> decompressed;  // zstd shards, once touched
  };
  std::string sample_bytes(int64_t index, const Shard** shard_out) const;
  MdsSample decode(const std::string& bytes, const Shard& shard, int64_t index) const;

  std::string dir_;
  std::vector<MdsColumn> columns_;
  std::vector<std::optional<int64_t>> sizes_;
  std::vector<Shard> shards_;
  int64_t total_ = 0;
  mutable std::mutex mutex_;
};

// Is `encoding` one this reader and writer handle? (Names of mosaicml-streaming's encodings.)
bool is_mds_encoding(const std::string& encoding);

// `replica mds convert`: JSONL (one object per line) or CSV (header row) to MDS. `columns`
// gives each column's encoding (e.g. {"user_id", "int64"}); a missing field, or a value that
// does not fit its encoding, is an error naming the file and line. Returns samples written.
int64_t convert_records_to_mds(const std::string& input, const std::string& out_dir,
                               const std::vector<MdsColumn>& columns, const MdsWriterOptions& options);

}  // namespace replica::data
