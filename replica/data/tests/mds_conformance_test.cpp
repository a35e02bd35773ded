// Conformance: replica's MDS shards (replica/data/mds.h) against mosaicml-streaming.
//
// - streaming's StreamingDataset (local=, no remote) reads what replica writes, with equal
//   values: every encoding replica writes (through MdsWriter, `replica mds convert` and
//   `replica mds synthetic`), uncompressed, zstd and zstd:LEVEL, one shard and several.
//   Where replica wrote the data set from values MDSWriter also takes, MDSWriter writes the same
//   samples again and its shard files must be replica's byte for byte (decompressed for zstd)
//   and its index.json the same JSON, over a sweep of size limits that puts every shard boundary
//   at every offset (referee/mds_referee.py read).
// - replica's MdsDataset reads what streaming's MDSWriter writes, every encoding replica reads
//   (all integer and float scalars, str, bytes, json, ndarray with every dtype code, dynamic and
//   fixed dtype and shape), uncompressed and zstd, with equal values, bit for bit
//   (referee/mds_referee.py write).
#include "replica/data/mds.h"
#include "replica/testing/paths.h"
#include "replica/testing/referee.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using replica::data::MdsColumn;
using replica::data::MdsDataset;
using replica::data::MdsSample;
using replica::data::MdsValue;
using replica::data::MdsWriter;
using replica::data::MdsWriterOptions;

namespace {

struct TempDir : replica::testing::ScratchDir {
  TempDir() : ScratchDir("replica-mds-conformance") {}
};

const fs::path kReferee = fs::path(REPLICA_SOURCE_DIR) / "replica/data/tests/referee/mds_referee.py";

// The referee's JSON form of a value (see mds_referee.py).
json float_json(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

const std::map<torch::ScalarType, std::string>& mds_dtype_names() {
  static const std::map<torch::ScalarType, std::string> names = {
      {torch::kUInt8, "uint8"},   {torch::kInt8, "int8"},     {torch::kUInt16, "uint16"}, {torch::kInt16, "int16"},
      {torch::kFloat16, "float16"}, {torch::kUInt32, "uint32"}, {torch::kInt32, "int32"}, {torch::kFloat32, "float32"},
      {torch::kUInt64, "uint64"}, {torch::kInt64, "int64"},   {torch::kFloat64, "float64"}};
  return names;
}

// Read through the raw bytes, so that the unsigned dtypes (which LibTorch supports only
// barely) need no kernels.
json tensor_json(const torch::Tensor& t) {
  json data = json::array();
  const torch::Tensor c = t.contiguous();
  const char* p = static_cast<const char*>(c.data_ptr());
  auto each = [&](auto zero, auto convert) {
    using T = decltype(zero);
    for (int64_t i = 0; i < c.numel(); ++i) {
      T v;
      std::memcpy(&v, p + i * sizeof(T), sizeof(T));
      data.push_back(convert(v));
    }
  };
  auto as_int = [](auto v) { return json(v); };
  auto as_float = [](auto v) { return float_json(static_cast<double>(v)); };
  switch (c.scalar_type()) {
    case torch::kUInt8: each(uint8_t{}, as_int); break;
    case torch::kInt8: each(int8_t{}, as_int); break;
    case torch::kUInt16: each(uint16_t{}, as_int); break;
    case torch::kInt16: each(int16_t{}, as_int); break;
    case torch::kUInt32: each(uint32_t{}, as_int); break;
    case torch::kInt32: each(int32_t{}, as_int); break;
    case torch::kUInt64: each(uint64_t{}, as_int); break;
    case torch::kInt64: each(int64_t{}, as_int); break;
    case torch::kFloat16: each(c10::Half{}, [](c10::Half v) { return float_json(static_cast<float>(v)); }); break;
    case torch::kFloat32: each(float{}, as_float); break;
    case torch::kFloat64: each(double{}, as_float); break;
    default: throw std::runtime_error(std::string("no MDS dtype for ") + c10::toString(c.scalar_type()));
  }
  return {{"dtype", mds_dtype_names().at(c.scalar_type())}, {"shape", c.sizes().vec()}, {"data", data}};
}

// The bytes a tensor of MDS dtype `dtype` holding `data` has (C order, little-endian).
std::string expected_bytes(const std::string& dtype, const json& data) {
  std::string out;
  auto put = [&](auto v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  auto real = [](const json& v) {
    if (v.is_string()) {
      const std::string s = v.get<std::string>();
      return s == "nan" ? std::numeric_limits<double>::quiet_NaN() : s == "inf" ? INFINITY : -INFINITY;
    }
    return v.get<double>();
  };
  for (const json& v : data) {
    if (dtype == "uint8") put(v.get<uint8_t>());
    else if (dtype == "int8") put(v.get<int8_t>());
    else if (dtype == "uint16") put(v.get<uint16_t>());
    else if (dtype == "int16") put(v.get<int16_t>());
    else if (dtype == "float16") put(c10::Half(static_cast<float>(real(v))));
    else if (dtype == "uint32") put(v.get<uint32_t>());
    else if (dtype == "int32") put(v.get<int32_t>());
    else if (dtype == "float32") put(static_cast<float>(real(v)));
    else if (dtype == "uint64") put(v.get<uint64_t>());
    else if (dtype == "int64") put(v.get<int64_t>());
    else if (dtype == "float64") put(real(v));
    else throw std::runtime_error("dtype " + dtype);
  }
  return out;
}

// Every encoding MdsWriter writes (ndarray with every dtype torch holds, dynamic and fixed).
const std::vector<MdsColumn> kColumns = {
    {"i8", "int8"},     {"i16", "int16"},   {"i32", "int32"},   {"i64", "int64"},   {"iint", "int"},
    {"u8", "uint8"},    {"u16", "uint16"},  {"u32", "uint32"},  {"u64", "uint64"},  {"f32", "float32"},
    {"f64", "float64"}, {"s", "str"},       {"b", "bytes"},     {"j", "json"},      {"nd", "ndarray"},
    {"nd_i32", "ndarray:int32"},           {"nd_f32_fixed", "ndarray:float32:2,3"},
    {"nd_f16", "ndarray:float16:4"},       {"nd_u8", "ndarray:uint8"},
    {"nd_i64_fixed", "ndarray:int64:3"},   {"nd_u16", "ndarray:uint16"},
    {"nd_u32_fixed", "ndarray:uint32:2,2"}, {"nd_uint", "ndarray"}};

struct Samples {
  std::vector<MdsSample> values;
  json spec = json::array();  // the same, in the referee's JSON form
};

// `count` samples for kColumns: integer extremes first, float specials (-0, infinities, NaN),
// UTF-8 text, bytes with NUL and 0xff, JSON in json.dumps' form (so that MDSWriter, given the
// parsed value, writes the same bytes), tensors of every torch dtype MDS has a code for.
Samples make_samples(int count) {
  Samples out;
  std::mt19937_64 rng(2024);
  torch::manual_seed(2024);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const double specials[] = {0.0, -0.0, 1.5, -3.25, 1e-30, 1e30, INFINITY, -INFINITY, NAN};
  const std::vector<torch::ScalarType> nd_types = {torch::kUInt8, torch::kInt8,    torch::kInt16, torch::kFloat16,
                                                   torch::kInt32, torch::kFloat32, torch::kInt64, torch::kFloat64};
  const std::vector<torch::ScalarType> unsigned_types = {torch::kUInt16, torch::kUInt32, torch::kUInt64};
  const std::vector<std::vector<int64_t>> shapes = {{1}, {3}, {2, 3}, {300}, {2, 1, 2}};
  auto random_tensor = [&](torch::ScalarType type, const std::vector<int64_t>& shape) {
    if (at::isFloatingType(type)) return (torch::randn(shape, torch::kFloat64) * 100).to(type);
    return torch::randint(0, 120, shape, torch::kInt64).to(type);
  };
  for (int i = 0; i < count; ++i) {
    MdsSample s;
    json j;
    auto integer = [&](const std::string& name, int64_t lo, int64_t hi) {
      const int64_t v = i == 0 ? lo : i == 1 ? hi : i == 2 ? 0 : uniform(lo, hi);
      s[name] = v;
      j[name] = v;
    };
    auto tensor = [&](const std::string& name, const torch::Tensor& t) {
      s[name] = t;
      j[name] = tensor_json(t);
    };
    integer("i8", -128, 127);
    integer("i16", -32768, 32767);
    integer("i32", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
    integer("i64", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
    integer("iint", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
    integer("u8", 0, 255);
    integer("u16", 0, 65535);
    integer("u32", 0, std::numeric_limits<uint32_t>::max());
    integer("u64", 0, std::numeric_limits<int64_t>::max());  // MdsValue's integers are int64
    const double f = i < 9 ? specials[i] : std::normal_distribution<double>(0, 1e3)(rng);
    const double f32 = static_cast<double>(static_cast<float>(f));
    s["f32"] = f32;
    j["f32"] = float_json(f32);
    s["f64"] = f;
    j["f64"] = float_json(f);
    const std::string strs[] = {"", "plain", "\u00fcn\u00efc\u00f6d\u00e9 \u2713 \u65e5\u672c\u8a9e",
                                "line\nbreak\ttab \"quoted\""};
    const std::string text = strs[i % 4] + std::string(static_cast<size_t>(i % 7), 'x');
    s["s"] = text;
    j["s"] = text;
    std::string bytes;
    for (int k = 0; k < i % 11; ++k) bytes.push_back(static_cast<char>(uniform(0, 255)));
    bytes += std::string("\0\xff", 2);
    s["b"] = bytes;
    j["b"] = {{"hex", hex(bytes)}};
    const std::string json_text = "{\"id\": " + std::to_string(i) + ", \"tags\": [" +
                                  std::string(i % 2 ? "\"a\", \"\\u00fc\"" : "") + "], \"score\": " +
                                  std::to_string(i) + ".25, \"nested\": {\"ok\": " + (i % 3 ? "true" : "false") +
                                  "}, \"none\": null}";
    s["j"] = json_text;
    j["j"] = json_text;
    const auto k = static_cast<size_t>(i);
    tensor("nd", random_tensor(nd_types[k % nd_types.size()], shapes[k % shapes.size()]));
    tensor("nd_i32", random_tensor(torch::kInt32, shapes[(k + 1) % shapes.size()]));
    tensor("nd_f32_fixed", random_tensor(torch::kFloat32, {2, 3}));
    tensor("nd_f16", random_tensor(torch::kFloat16, {4}));
    tensor("nd_u8", random_tensor(torch::kUInt8, shapes[(k + 2) % shapes.size()]));
    tensor("nd_i64_fixed", random_tensor(torch::kInt64, {3}) * 1000000007LL - 5);
    tensor("nd_u16", random_tensor(torch::kUInt16, shapes[(k + 3) % shapes.size()]));
    tensor("nd_u32_fixed", random_tensor(torch::kUInt32, {2, 2}));
    tensor("nd_uint", random_tensor(unsigned_types[k % unsigned_types.size()], shapes[(k + 4) % shapes.size()]));
    out.values.push_back(std::move(s));
    out.spec.push_back(std::move(j));
  }
  return out;
}

// Writes `samples` with replica's MdsWriter; returns the referee's entry for the data set.
json write_with_replica(const fs::path& dir, const std::vector<MdsColumn>& columns, const Samples& samples,
                        const MdsWriterOptions& options, bool twin, bool read = true) {
  MdsWriter writer(dir.string(), columns, options);
  for (const auto& s : samples.values) writer.write(s);
  writer.finish();
  return {{"dir", dir.string()}, {"samples", samples.spec}, {"twin", twin}, {"read", read}};
}

replica::testing::Result replica_run(const std::vector<std::string>& args) {
  return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(120));
}

std::vector<json> read_jsonl(const fs::path& file) {
  std::vector<json> lines;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(json::parse(line));
  }
  return lines;
}

// Does replica's value `got` (column encoding `encoding`) equal the referee's `want`?
::testing::AssertionResult same_value(const std::string& encoding, const MdsValue& got, const json& want) {
  auto fail = [&](const std::string& what) { return ::testing::AssertionFailure() << encoding << ": " << what << " vs " << want.dump(); };
  if (encoding.rfind("ndarray", 0) == 0) {
    const auto* t = std::get_if<torch::Tensor>(&got);
    if (t == nullptr) return fail("not a tensor");
    const auto name = mds_dtype_names().find(t->scalar_type());
    if (name == mds_dtype_names().end() || name->second != want["dtype"].get<std::string>()) {
      return fail(std::string("dtype ") + c10::toString(t->scalar_type()));
    }
    if (t->sizes().vec() != want["shape"].get<std::vector<int64_t>>()) return fail("shape " + c10::str(t->sizes()));
    const torch::Tensor c = t->contiguous();
    const std::string bytes(static_cast<const char*>(c.data_ptr()), c.nbytes());
    if (bytes != expected_bytes(name->second, want["data"])) return fail("values");
    return ::testing::AssertionSuccess();
  }
  if (encoding == "float32" || encoding == "float64") {
    const auto* d = std::get_if<double>(&got);
    if (d == nullptr) return fail("not a float");
    if (want.is_string()) {
      const std::string w = want.get<std::string>();
      const bool ok = w == "nan" ? std::isnan(*d) : *d == (w == "inf" ? INFINITY : -INFINITY);
      return ok ? ::testing::AssertionSuccess() : fail(std::to_string(*d));
    }
    const double w = want.get<double>();
    return *d == w && std::signbit(*d) == std::signbit(w) ? ::testing::AssertionSuccess() : fail(std::to_string(*d));
  }
  if (encoding == "str" || encoding == "bytes" || encoding == "json") {
    const auto* text = std::get_if<std::string>(&got);
    if (text == nullptr) return fail("not text");
    if (encoding == "bytes") return hex(*text) == want["hex"].get<std::string>() ? ::testing::AssertionSuccess() : fail(hex(*text));
    if (encoding == "json") return json::parse(*text) == json::parse(want.get<std::string>()) ? ::testing::AssertionSuccess() : fail(*text);
    return *text == want.get<std::string>() ? ::testing::AssertionSuccess() : fail(*text);
  }
  const auto* i = std::get_if<int64_t>(&got);
  if (i == nullptr) return fail("not an integer");
  // uint64 above 2^63 arrives wrapped (MdsValue's integers are int64): compare the bits.
  const uint64_t w = want.is_number_unsigned() ? want.get<uint64_t>() : static_cast<uint64_t>(want.get<int64_t>());
  return static_cast<uint64_t>(*i) == w ? ::testing::AssertionSuccess() : fail(std::to_string(*i));
}

}  // namespace

TEST(MdsConformance, StreamingReadsWhatReplicaWrites) {
  REPLICA_REQUIRE_PYTHON("streaming", "numpy");
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  TempDir dir;
  json spec = {{"datasets", json::array()}};

  // MdsWriter, every encoding: several shards uncompressed, zstd, zstd:LEVEL, one shard.
  const Samples samples = make_samples(30);
  spec["datasets"].push_back(write_with_replica(dir.path / "api-plain", kColumns, samples, {"", 4096}, true));
  spec["datasets"].push_back(write_with_replica(dir.path / "api-zstd", kColumns, samples, {"zstd", 4096}, true));
  spec["datasets"].push_back(write_with_replica(dir.path / "api-zstd7", kColumns, samples, {"zstd:7", std::nullopt}, true));

  // Shard boundaries: the same 12 samples (22 bytes each with their offset) at every size
  // limit from 250 to 300 bytes, so that a shard ends at every distance from the limit.
  {
    const std::vector<MdsColumn> small = {{"n", "int32"}, {"s", "str"}};
    Samples few;
    for (int i = 0; i < 12; ++i) {
      few.values.push_back({{"n", int64_t{i}}, {"s", std::string("sample-") + static_cast<char>('a' + i) + "xx"}});
      few.spec.push_back({{"n", i}, {"s", std::string("sample-") + static_cast<char>('a' + i) + "xx"}});
    }
    for (int64_t limit = 250; limit <= 300; ++limit) {
      spec["datasets"].push_back(write_with_replica(dir.path / ("limit-" + std::to_string(limit)), small, few,
                                                    {"", limit}, true, /*read=*/limit % 10 == 0));
    }
  }

  // `replica mds convert` from JSONL, zstd.
  {
    const fs::path input = dir.path / "records.jsonl";
    json samples_spec = json::array();
    std::ofstream out(input);
    for (int i = 0; i < 20; ++i) {
      const std::vector<double> vec = {i * 0.5, -1.0 / (i + 1), 3.0};
      json vec_data = json::array();
      for (double v : vec) vec_data.push_back(static_cast<double>(static_cast<float>(v)));
      const json meta = {{"k", i}, {"name", "n\u00e4me " + std::to_string(i)}, {"list", {1, 2, i}}};
      const json grid = {i, i + 1, -i, 7};
      const json record = {{"id", int64_t{1} << 40 | i}, {"name", "item " + std::to_string(i) + " \u2713"},
                           {"score", i / 3.0}, {"small", i * 12 % 256}, {"meta", meta}, {"vec", vec}, {"grid", grid}};
      out << record.dump() << "\n";
      samples_spec.push_back({{"id", record["id"]}, {"name", record["name"]}, {"score", record["score"]},
                              {"small", record["small"]}, {"meta", meta.dump()},
                              {"vec", {{"dtype", "float32"}, {"shape", {3}}, {"data", vec_data}}},
                              {"grid", {{"dtype", "int32"}, {"shape", {2, 2}}, {"data", grid}}}});
    }
    out.close();
    const auto r = replica_run({"mds", "convert", "--input", input.string(), "--out", (dir.path / "convert").string(),
                                "--columns", "id:int64,name:str,score:float64,small:uint8,meta:json,vec:ndarray:float32,grid:ndarray:int32:2,2",
                                "--compression", "zstd", "--size-limit", "1024"});
    ASSERT_EQ(r.exit_code, 0) << r;
    spec["datasets"].push_back({{"dir", (dir.path / "convert").string()}, {"samples", samples_spec}, {"twin", false}});
  }

  // `replica mds synthetic` (the two-tower data), zstd; the values are those of the same data
  // written as JSONL (same seed).
  {
    const std::vector<std::string> common = {"--users", "60", "--items", "40", "--clusters", "4", "--train", "150",
                                             "--valid", "30", "--seed", "5"};
    std::vector<std::string> mds = {"mds", "synthetic", "--out", (dir.path / "synthetic").string(), "--compression", "zstd"};
    std::vector<std::string> jsonl = {"mds", "synthetic", "--out", (dir.path / "synthetic-jsonl").string(), "--format", "jsonl"};
    mds.insert(mds.end(), common.begin(), common.end());
    jsonl.insert(jsonl.end(), common.begin(), common.end());
    const auto a = replica_run(mds);
    ASSERT_EQ(a.exit_code, 0) << a;
    const auto b = replica_run(jsonl);
    ASSERT_EQ(b.exit_code, 0) << b;
    for (const std::string split : {"train", "valid"}) {
      const auto lines = read_jsonl(dir.path / "synthetic-jsonl" / (split + ".jsonl"));
      ASSERT_FALSE(lines.empty());
      spec["datasets"].push_back({{"dir", (dir.path / "synthetic" / split).string()}, {"samples", lines}, {"twin", true}});
    }
  }

  const fs::path spec_file = dir.path / "spec.json";
  std::ofstream(spec_file) << spec.dump();
  const auto run = replica::testing::run_python(kReferee, {"read", spec_file.string()});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::cerr << run.output;
}

TEST(MdsConformance, ReplicaReadsWhatStreamingWrites) {
  REPLICA_REQUIRE_PYTHON("streaming", "numpy");
  TempDir dir;
  const auto run = replica::testing::run_python(kReferee, {"write", dir.path.string()});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::cerr << run.output;
  std::ifstream spec_stream(dir.path / "spec.json");
  const json spec = json::parse(spec_stream);
  ASSERT_GE(spec["datasets"].size(), 3u);
  int64_t compared = 0;
  for (const auto& ds_spec : spec["datasets"]) {
    SCOPED_TRACE(ds_spec["dir"].get<std::string>());
    MdsDataset ds(ds_spec["dir"].get<std::string>());
    const json& samples = ds_spec["samples"];
    ASSERT_EQ(ds.size(), static_cast<int64_t>(samples.size()));
    std::map<std::string, std::string> encodings;
    for (const auto& c : ds.columns()) encodings[c.name] = c.encoding;
    for (size_t i = 0; i < samples.size(); ++i) {
      MdsSample got;
      ASSERT_NO_THROW(got = ds.get(static_cast<int64_t>(i))) << "sample " << i;
      ASSERT_EQ(got.size(), samples[i].size());
      for (const auto& [name, want] : samples[i].items()) {
        ASSERT_TRUE(got.count(name)) << name;
        EXPECT_TRUE(same_value(encodings.at(name), got.at(name), want)) << "sample " << i << " column " << name;
        ++compared;
      }
    }
  }
  std::cerr << compared << " values read by replica equal to MDSWriter's\n";
}
