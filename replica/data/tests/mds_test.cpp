#include "replica/core/error.h"
#include "replica/data/mds.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace fs = std::filesystem;
using namespace replica::data;

namespace {

class Mds : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("replica_mds_{}_{}", ::getpid(),
                                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const std::vector<MdsColumn> kColumns = {
    {"id", "int64"},        {"small", "int32"},       {"label", "uint8"},     {"score", "float32"},
    {"weight", "float64"},  {"name", "str"},          {"blob", "bytes"},      {"vec", "ndarray:float32:3"},
    {"any", "ndarray"},     {"ints", "ndarray:int64"}, {"meta", "json"},       {"big", "int"},
};

MdsSample make_sample(int64_t i) {
  MdsSample s;
  s["id"] = i * 1000003;
  s["small"] = -i;
  s["label"] = i % 256;
  s["score"] = 0.5 * static_cast<double>(i);
  s["weight"] = 1.0 / (1.0 + static_cast<double>(i));
  s["name"] = std::string(static_cast<size_t>(i % 7), 'a' + static_cast<char>(i % 26)) + "é";
  s["blob"] = std::string("\0\xff", 2) + std::to_string(i);
  s["vec"] = torch::arange(3, torch::kFloat) + static_cast<float>(i);
  s["any"] = torch::arange(6, torch::kInt16).reshape({2, 3}) * static_cast<int16_t>(i);
  s["ints"] = torch::arange(i % 5 + 1, torch::kLong);
  s["meta"] = std::string(fmt::format("{{\"i\": {}}}", i));
  s["big"] = int64_t{1} << 40;
  return s;
}

void expect_same(const MdsSample& a, const MdsSample& b, int64_t i) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, va] : a) {
    const auto& vb = b.at(name);
    if (const auto* t = std::get_if<torch::Tensor>(&va)) {
      const auto& u = std::get<torch::Tensor>(vb);
      EXPECT_EQ(t->scalar_type(), u.scalar_type()) << name << " sample " << i;
      EXPECT_TRUE(torch::equal(*t, u)) << name << " sample " << i;
    } else if (const auto* d = std::get_if<double>(&va)) {
      // float32 columns keep float precision.
      EXPECT_FLOAT_EQ(static_cast<float>(*d), static_cast<float>(std::get<double>(vb))) << name << " sample " << i;
    } else if (const auto* n = std::get_if<int64_t>(&va)) {
      EXPECT_EQ(*n, std::get<int64_t>(vb)) << name << " sample " << i;
    } else {
      EXPECT_EQ(std::get<std::string>(va), std::get<std::string>(vb)) << name << " sample " << i;
    }
  }
}

void write_samples(const fs::path& dir, int64_t n, MdsWriterOptions options) {
  MdsWriter w(dir.string(), kColumns, options);
  for (int64_t i = 0; i < n; ++i) w.write(make_sample(i));
  w.finish();
}

}  // namespace

TEST_F(Mds, RoundTripsEveryEncodingAcrossShards) {
  MdsWriterOptions options;
  options.size_limit = 2048;  // forces several shards
  write_samples(dir_, 100, options);
  const auto index = nlohmann::json::parse(slurp(dir_ / "index.json"));
  ASSERT_GT(index["shards"].size(), 2u);
  MdsDataset ds(dir_.string());
  ASSERT_EQ(ds.size(), 100);
  for (int64_t i = 0; i < 100; ++i) expect_same(make_sample(i), ds.get(i), i);
  // Every shard respects the size limit.
  for (const auto& shard : index["shards"]) EXPECT_LE(shard["raw_data"]["bytes"].get<int64_t>(), 2048);
}

TEST_F(Mds, RoundTripsZstdShards) {
  MdsWriterOptions options;
  options.compression = "zstd:7";
  options.size_limit = 4096;
  write_samples(dir_, 60, options);
  const auto index = nlohmann::json::parse(slurp(dir_ / "index.json"));
  for (const auto& shard : index["shards"]) {
    EXPECT_EQ(shard["compression"], "zstd:7");
    const std::string zip = shard["zip_data"]["basename"];
    EXPECT_EQ(zip, shard["raw_data"]["basename"].get<std::string>() + ".zstd");
    EXPECT_TRUE(fs::exists(dir_ / zip));
    EXPECT_FALSE(fs::exists(dir_ / shard["raw_data"]["basename"].get<std::string>()));
  }
  MdsDataset ds(dir_.string());
  ASSERT_EQ(ds.size(), 60);
  for (int64_t i = 59; i >= 0; --i) expect_same(make_sample(i), ds.get(i), i);
}

// The bytes follow mosaicml-streaming's layout: index.json fields, and a shard that is
// num_samples | offsets | sorted-key config JSON | samples with a size header per
// variable-size column.
TEST_F(Mds, FollowsThePublishedLayout) {
  {
    MdsWriter w(dir_.string(), {{"text", "str"}, {"id", "int32"}});
    w.write({{"id", int64_t{7}}, {"text", std::string("hi")}});
    w.write({{"id", int64_t{-1}}, {"text", std::string("abc")}});
    w.finish();
  }
  const auto index = nlohmann::json::parse(slurp(dir_ / "index.json"));
  EXPECT_EQ(index["version"], 2);
  ASSERT_EQ(index["shards"].size(), 1u);
  const auto& s = index["shards"][0];
  EXPECT_EQ(s["format"], "mds");
  EXPECT_EQ(s["version"], 2);
  EXPECT_EQ(s["samples"], 2);
  EXPECT_EQ(s["column_names"], nlohmann::json({"id", "text"}));  // sorted, as MDSWriter does
  EXPECT_EQ(s["column_encodings"], nlohmann::json({"int32", "str"}));
  EXPECT_EQ(s["column_sizes"], nlohmann::json({4, nullptr}));
  EXPECT_TRUE(s["compression"].is_null());
  EXPECT_TRUE(s["zip_data"].is_null());
  EXPECT_EQ(s["raw_data"]["basename"], "shard.00000.mds");

  const std::string shard = slurp(dir_ / "shard.00000.mds");
  EXPECT_EQ(s["raw_data"]["bytes"].get<size_t>(), shard.size());
  auto u32 = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, shard.data() + at, 4);
    return v;
  };
  ASSERT_EQ(u32(0), 2u);
  const std::string config =
      "{\"column_encodings\": [\"int32\", \"str\"], \"column_names\": [\"id\", \"text\"], \"column_sizes\": [4, null], "
      "\"compression\": null, \"format\": \"mds\", \"hashes\": [], \"size_limit\": 67108864, \"version\": 2}";
  const size_t start = 4 + 3 * 4 + config.size();
  EXPECT_EQ(shard.substr(16, config.size()), config);
  EXPECT_EQ(u32(4), start);
  // Sample 0: [size of text = 2][id = 7][h i]
  EXPECT_EQ(u32(8), start + 4 + 4 + 2);
  EXPECT_EQ(u32(start), 2u);
  EXPECT_EQ(u32(start + 4), 7u);
  EXPECT_EQ(shard.substr(start + 8, 2), "hi");
  EXPECT_EQ(u32(12), shard.size());
}

TEST_F(Mds, ConvertsJsonlAndCsv) {
  const fs::path jsonl = dir_ / "in.jsonl";
  std::ofstream(jsonl) << "{\"user\": 1, \"item\": 10, \"title\": \"a\", \"emb\": [1, 2]}\n"
                       << "{\"user\": 2, \"item\": 20, \"title\": \"b\", \"emb\": [3, 4]}\n";
  const std::vector<MdsColumn> cols = {{"user", "int64"}, {"item", "int32"}, {"title", "str"}, {"emb", "ndarray:float32"}};
  EXPECT_EQ(convert_records_to_mds(jsonl.string(), (dir_ / "a").string(), cols, {}), 2);
  MdsDataset a((dir_ / "a").string());
  ASSERT_EQ(a.size(), 2);
  EXPECT_EQ(std::get<int64_t>(a.get(1).at("item")), 20);
  EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(a.get(1).at("emb")), torch::tensor({3.f, 4.f})));
  EXPECT_TRUE(torch::equal(a.int_column("user", {1, 0}), torch::tensor({2, 1}, torch::kLong)));

  const fs::path csv = dir_ / "in.csv";
  std::ofstream(csv) << "user,item,title\n5,50,x\n6,60,y\n";
  EXPECT_EQ(convert_records_to_mds(csv.string(), (dir_ / "b").string(), {{"user", "int64"}, {"item", "int64"}, {"title", "str"}},
                                   {"zstd", std::nullopt}),
            2);
  MdsDataset b((dir_ / "b").string());
  EXPECT_EQ(std::get<std::string>(b.get(0).at("title")), "x");
  EXPECT_EQ(std::get<int64_t>(b.get(1).at("item")), 60);
}

TEST_F(Mds, BadInputsAreErrorsNamingTheirSource) {
  auto expect_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const replica::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { MdsDataset((dir_ / "none").string()); }, "index.json");
  expect_error([&] { MdsWriter(dir_.string() + "/w", {{"x", "float128"}}); }, "'x'");
  expect_error([&] {
    MdsWriter w((dir_ / "w2").string(), {{"x", "int8"}});
    w.write({{"x", int64_t{300}}});
  }, "does not fit");
  const fs::path bad = dir_ / "bad.jsonl";
  std::ofstream(bad) << "{\"x\": 1}\n{\"x\": \"oops\"}\n";
  expect_error([&] { convert_records_to_mds(bad.string(), (dir_ / "w3").string(), {{"x", "int64"}}, {}); }, "record 2");
  EXPECT_FALSE(fs::exists(dir_ / "w3" / "index.json"));  // a failed conversion is not a data set

  // A truncated shard is named, when the data set is opened (its length is not raw_data.bytes)
  // or, cut after that, when the sample is read.
  write_samples(dir_ / "t", 5, {});
  const fs::path shard = dir_ / "t" / "shard.00000.mds";
  const auto length = fs::file_size(shard);
  fs::resize_file(shard, length - 10);
  expect_error([&] { MdsDataset((dir_ / "t").string()); }, "'raw_data.bytes' is");
  fs::resize_file(shard, length);
  MdsDataset t((dir_ / "t").string());
  fs::resize_file(shard, length - 10);
  expect_error([&] { t.get(4); }, "shard.00000.mds");
}

// MDSWriter's rule: a shard takes the next sample while its file stays within size_limit, so a
// shard may fill the limit exactly (replica stopped 4 bytes short until the streaming referee,
// MdsConformance, showed the shards differ).
TEST_F(Mds, AShardFillsItsSizeLimitExactly) {
  // The shard's config holds size_limit, so the 4-sample shard is measured under a limit of
  // as many digits as its own size.
  write_samples(dir_ / "one", 4, {"", 999});
  const int64_t four = static_cast<int64_t>(fs::file_size(dir_ / "one" / "shard.00000.mds"));
  ASSERT_TRUE(four >= 100 && four <= 999) << four;
  write_samples(dir_ / "limit", 8, {"", four});
  const auto index = nlohmann::json::parse(slurp(dir_ / "limit" / "index.json"));
  ASSERT_GE(index["shards"].size(), 2u);
  EXPECT_EQ(index["shards"][0]["samples"], 4);
  EXPECT_EQ(index["shards"][0]["raw_data"]["bytes"], four);
  write_samples(dir_ / "short", 8, {"", four - 1});
  EXPECT_EQ(nlohmann::json::parse(slurp(dir_ / "short" / "index.json"))["shards"][0]["samples"], 3);
}

// streaming's NDArray dtype codes 16, 32, 64 (uint16, uint32, uint64) are LibTorch's unsigned
// dtypes (2.3 onwards); before, replica accepted such columns and failed on every sample.
TEST_F(Mds, UnsignedNdarraysRoundTrip) {
  const std::vector<MdsColumn> columns = {{"a", "ndarray"}, {"b", "ndarray:uint32"}, {"c", "ndarray:uint64:2"}};
  MdsWriter w((dir_ / "u").string(), columns);
  const uint64_t big = (uint64_t{1} << 63) + 5;
  torch::Tensor c = torch::empty({2}, torch::kUInt64);
  std::memcpy(c.data_ptr(), &big, sizeof(big));
  std::memcpy(static_cast<char*>(c.data_ptr()) + 8, &big, sizeof(big));
  const torch::Tensor a = torch::full({5}, 65535, torch::kLong).to(torch::kUInt16);
  const torch::Tensor b = torch::arange(6, torch::kLong).reshape({2, 3}).to(torch::kUInt32);
  w.write({{"a", a}, {"b", b}, {"c", c}});
  w.finish();
  const MdsSample s = MdsDataset((dir_ / "u").string()).get(0);
  for (const auto& [name, want] : std::map<std::string, torch::Tensor>{{"a", a}, {"b", b}, {"c", c}}) {
    const auto& got = std::get<torch::Tensor>(s.at(name));
    EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), want.sizes()) << name;
    EXPECT_EQ(0, std::memcmp(got.data_ptr(), want.contiguous().data_ptr(), want.nbytes())) << name;
  }
}
