#include "replica/io/safetensors.h"

#include "replica/core/error.h"

#include "replica/testing/error_in_child.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <random>
#include <sstream>

namespace fs = std::filesystem;
using replica::io::load_safetensors;
using replica::io::NamedTensors;
using replica::io::save_safetensors;

namespace {

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "replica_st_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  static std::string read_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  }

  static void write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }

  // A file with the given header text and `data_bytes` zero bytes of data.
  std::string raw_file(const std::string& header, size_t data_bytes,
                       const std::string& name = "bad.safetensors") {
    std::string bytes(8, '\0');
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    bytes += header;
    bytes += std::string(data_bytes, '\0');
    const std::string path = file(name);
    write_bytes(path, bytes);
    return path;
  }

  // The replica::Error message loading `path` gives; fails the test when it loads.
  static std::string load_error(const std::string& path) {
    try {
      load_safetensors(path);
    } catch (const replica::Error& e) {
      return e.what();
    }
    ADD_FAILURE() << path << " loaded without error";
    return "";
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, RoundTripsEveryDtypeShapeAndMetadata) {
  torch::manual_seed(0);
  NamedTensors tensors = {
      {"f64", torch::randn({3, 4}, torch::kFloat64)},
      {"f32", torch::randn({2, 3, 5})},
      {"f16", torch::randn({7}).to(torch::kFloat16)},
      {"bf16", torch::randn({4, 2}).to(torch::kBFloat16)},
      {"i64", torch::randint(-1000000, 1000000, {5}, torch::kInt64)},
      {"i32", torch::randint(-1000, 1000, {2, 2}, torch::kInt32)},
      {"i16", torch::randint(-300, 300, {3}, torch::kInt16)},
      {"i8", torch::randint(-128, 127, {9}, torch::kInt8)},
      {"u8", torch::randint(0, 255, {4, 1}, torch::kUInt8)},
      {"bool", torch::randint(0, 2, {6}).to(torch::kBool)},
      {"scalar", torch::tensor(3.25)},
      {"empty", torch::empty({0, 3})},
      {"transposed", torch::arange(12, torch::kFloat32).reshape({3, 4}).t()},
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "12"}};
  const std::string path = file("model.safetensors");
  save_safetensors(path, tensors, metadata);

  auto loaded = load_safetensors(path);
  EXPECT_EQ(loaded.path, path);
  EXPECT_EQ(loaded.metadata, metadata);
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    // replica writes data in the order given, and reads sort by offset: same order.
    EXPECT_EQ(loaded.tensors[i].first, tensors[i].first);
    const auto& expected = tensors[i].second;
    const auto& got = loaded.at(tensors[i].first);
    EXPECT_EQ(got.scalar_type(), expected.scalar_type()) << tensors[i].first;
    EXPECT_EQ(got.sizes(), expected.sizes()) << tensors[i].first;
    EXPECT_TRUE(torch::equal(got, expected)) << tensors[i].first;
    EXPECT_TRUE(got.is_contiguous());
  }
  EXPECT_EQ(loaded.at("scalar").dim(), 0);
  EXPECT_TRUE(loaded.contains("bf16"));
  EXPECT_FALSE(loaded.contains("nope"));

  // The tensors own their memory: they outlive the file and do not alias each other.
  fs::remove(path);
  auto f32 = loaded.at("f32");
  f32.fill_(1.0f);
  EXPECT_TRUE(torch::equal(loaded.at("f64"), tensors[0].second));
  EXPECT_EQ(f32.sum().item<float>(), 30.0f);
}

TEST_F(SafetensorsTest, WritesTheReferenceLayout) {
  const std::string path = file("a.safetensors");
  save_safetensors(path, {{"a", torch::tensor({1.0f, 2.0f})}});
  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  EXPECT_EQ((8 + n) % 8, 0u) << "data section must start 8-byte aligned";
  const std::string json = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_EQ(bytes.size(), 8 + n + 8);
  EXPECT_EQ(bytes.substr(8, json.size()), json);
  EXPECT_EQ(bytes.substr(8 + json.size(), n - json.size()), std::string(n - json.size(), ' '));
  float values[2];
  std::memcpy(values, bytes.data() + 8 + n, sizeof(values));
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[1], 2.0f);
}

TEST_F(SafetensorsTest, ReadsFilesWrittenByOtherWriters) {
  // Unpadded header, tensors listed out of data order, metadata first: all legal.
  std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"I16","shape":[1],"data_offsets":[4,6]},)"
      R"("a":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]}})";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  bytes += header;
  bytes += std::string("\x01\x02\x03\x04\x2c\x01", 6);  // b = 300 little-endian
  write_bytes(file("other.safetensors"), bytes);
  auto loaded = load_safetensors(file("other.safetensors"));
  ASSERT_EQ(loaded.tensors.size(), 2u);
  EXPECT_EQ(loaded.tensors[0].first, "a");
  EXPECT_EQ(loaded.tensors[1].first, "b");
  EXPECT_TRUE(torch::equal(loaded.at("a"), torch::tensor({1, 2, 3, 4}, torch::kUInt8).reshape({2, 2})));
  EXPECT_EQ(loaded.at("b").item<int16_t>(), 300);
  EXPECT_EQ(loaded.metadata.at("format"), "pt");
}

TEST_F(SafetensorsTest, EmptyFileListRoundTrips) {
  save_safetensors(file("none.safetensors"), {});
  auto loaded = load_safetensors(file("none.safetensors"));
  EXPECT_TRUE(loaded.tensors.empty());
  EXPECT_TRUE(loaded.metadata.empty());
}

TEST_F(SafetensorsTest, SaveIsAtomicAndReplacesTheOldFile) {
  const std::string path = file("w.safetensors");
  save_safetensors(path, {{"w", torch::zeros({2})}});
  save_safetensors(path, {{"w", torch::ones({3})}});
  EXPECT_TRUE(torch::equal(load_safetensors(path).at("w"), torch::ones({3})));
  // Nothing but the file itself is left in the directory (no PATH.tmp.<pid>).
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir_)) names.push_back(entry.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"w.safetensors"});
}

TEST_F(SafetensorsTest, SaveRefusesBadInputNamingTheTensor) {
  const std::string path = file("x.safetensors");
  auto save_error = [&](const NamedTensors& tensors) -> std::string {
    try {
      save_safetensors(path, tensors);
    } catch (const replica::Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "saved without error";
    return "";
  };
  EXPECT_NE(save_error({{"c", torch::zeros({2}, torch::kComplexFloat)}}).find("tensor 'c'"),
            std::string::npos);
  EXPECT_NE(
      save_error({{"d", torch::zeros({1})}, {"d", torch::zeros({1})}}).find("tensor 'd' is given twice"),
      std::string::npos);
  EXPECT_NE(save_error({{"u", torch::Tensor()}}).find("tensor 'u' is undefined"), std::string::npos);
  EXPECT_NE(save_error({{"__metadata__", torch::zeros({1})}}).find("reserved"), std::string::npos);
  EXPECT_FALSE(fs::exists(path));
  try {
    save_safetensors(file("missing-dir/x.safetensors"), {{"a", torch::zeros({1})}});
    ADD_FAILURE() << "saved into a missing directory";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing-dir/x.safetensors"), std::string::npos) << e.what();
  }
}

TEST_F(SafetensorsTest, AtNamesTheFileAndSuggests) {
  save_safetensors(file("m.safetensors"), {{"fc.weight", torch::zeros({1})}});
  auto loaded = load_safetensors(file("m.safetensors"));
  try {
    loaded.at("fc.weigth");
    ADD_FAILURE() << "found a missing tensor";
  } catch (const replica::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              file("m.safetensors") + ": no tensor named 'fc.weigth' (did you mean 'fc.weight'?)");
  }
}

TEST_F(SafetensorsTest, MalformedFilesAreErrorsNamingFileAndTensor) {
  struct Case {
    std::string header;
    size_t data_bytes;
    std::string expected;  // substring after "PATH: "
  };
  const std::vector<Case> cases = {
      {"not json", 0, "header is not valid JSON"},
      {"[1, 2]", 0, "header is not a JSON object"},
      {R"({"w": 5})", 0, "tensor 'w': header entry is not a JSON object"},
      {R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 4, "tensor 'w': missing string field 'dtype'"},
      {R"({"w": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}})", 1,
       "tensor 'w': unsupported dtype 'F8_E4M3'"},
      {R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 4, "tensor 'w': missing list field 'shape'"},
      {R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4,
       "tensor 'w': negative dimension -1"},
      {R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 4]}})", 4,
       "tensor 'w': shape entry 2.5 is not an integer"},
      {R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 4]}})", 4,
       "tensor 'w': shape [4611686018427387904, 4] is too large"},
      {R"({"w": {"dtype": "F32", "shape": [0, 4611686018427387904, 4], "data_offsets": [0, 0]}})", 0,
       "tensor 'w': shape [0, 4611686018427387904, 4] is too large"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4,
       "tensor 'w': 'data_offsets' must be a list of two non-negative integers"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 4,
       "tensor 'w': 'data_offsets' must be a list of two non-negative integers"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", 4,
       "tensor 'w': data_offsets [4, 0] end before they begin"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}})", 4,
       "tensor 'w': data_offsets [0, 8] reach past the end of the data (4 bytes)"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551615]}})", 4,
       "tensor 'w': data_offsets [0, 18446744073709551615] reach past the end"},
      {R"({"fc.weight": {"dtype": "F32", "shape": [10, 10], "data_offsets": [0, 100]}})", 100,
       "tensor 'fc.weight': data_offsets [0, 100] do not match shape [10, 10] of F32 (400 bytes)"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
       R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       12, "tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
       R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
       12, "tensor 'b': data_offsets [8, 12] leave a gap of 4 unused bytes before it"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8,
       "tensor 'a': data_offsets [4, 8] leave a gap of 4 unused bytes before it"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 8,
       "4 bytes after the last tensor's data are not covered by any tensor"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
       R"( "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
       8, "tensor 'w' appears twice in the header"},
      {R"({"w": {"dtype": "F32", "dtype": "I8", "shape": [1], "data_offsets": [0, 4]}})", 4,
       "'w': key 'dtype' appears twice"},
      {R"({"__metadata__": {"step": 3}})", 0, "'__metadata__' value for 'step' is not a string"},
      {R"({"__metadata__": [1]})", 0, "'__metadata__' is not a JSON object"},
  };
  for (const auto& c : cases) {
    const std::string path = raw_file(c.header, c.data_bytes);
    const std::string message = load_error(path);
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << "message must start with the path: " << message;
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << "header " << c.header << "\n  got: " << message << "\n  want: " << c.expected;
  }
  // The example of the product contract, verbatim.
  const std::string path = raw_file(R"({"fc.weight":{"dtype":"F32","shape":[10,10],"data_offsets":[0,100]}})",
                                    100, "model.safetensors");
  EXPECT_EQ(
      load_error(path),
      path + ": tensor 'fc.weight': data_offsets [0, 100] do not match shape [10, 10] of F32 (400 bytes)");
}

TEST_F(SafetensorsTest, TruncatedAndShortFilesAreErrors) {
  const std::string short_path = file("short.safetensors");
  write_bytes(short_path, "abcd");
  EXPECT_EQ(load_error(short_path),
            short_path + ": file is 4 bytes, too short for a safetensors header (8 bytes)");

  const std::string lying = file("lying.safetensors");
  write_bytes(lying, std::string("\xff\x00\x00\x00\x00\x00\x00\x00{}", 10));
  EXPECT_EQ(load_error(lying), lying + ": header length 255 is larger than the rest of the file (2 bytes)");

  const std::string huge = file("huge.safetensors");
  write_bytes(huge, std::string("\xff\xff\xff\xff\xff\xff\xff\xff{}", 10));
  EXPECT_NE(load_error(huge).find("is larger than the rest of the file"), std::string::npos);

  EXPECT_NE(load_error(file("absent.safetensors")).find("cannot open '" + file("absent.safetensors") + "': No such file"),
            std::string::npos);

  // Every strict prefix of a valid file is refused with a replica::Error.
  const std::string full = file("full.safetensors");
  save_safetensors(full,
                   {{"a", torch::arange(6, torch::kInt32)}, {"b", torch::ones({2, 2}, torch::kBFloat16)}});
  const std::string bytes = read_bytes(full);
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::string path = file("prefix.safetensors");
    write_bytes(path, bytes.substr(0, n));
    EXPECT_FALSE(load_error(path).empty()) << "prefix of " << n << " bytes";
  }
}

TEST_F(SafetensorsTest, BoolBytesOtherThanZeroOrOneAreRefused) {
  std::string path = raw_file(R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", 0);
  std::ofstream(path, std::ios::binary | std::ios::app).write("\x01\x02", 2);
  EXPECT_NE(load_error(path).find("tensor 'm': BOOL byte 1 has value 2"), std::string::npos);
}

TEST_F(SafetensorsTest, CorruptedHeadersNeverCrash) {
  // Flip random header bytes of a valid file: each load either succeeds or is a replica::Error.
  const std::string path = file("fuzz.safetensors");
  save_safetensors(path,
                   {{"weight", torch::randn({3, 2})},
                    {"bias", torch::arange(4, torch::kInt64)},
                    {"mask", torch::ones({5}, torch::kBool)}},
                   {{"k", "v"}});
  const std::string original = read_bytes(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(original[i])) << (8 * i);
  std::mt19937 rng(1234);
  std::uniform_int_distribution<size_t> position(0, 8 + n - 1);
  const std::string alphabet = "0123456789[]{}\",:-.e FIUBOL_";
  std::uniform_int_distribution<size_t> pick(0, alphabet.size() - 1);
  std::uniform_int_distribution<int> flips(1, 4);
  int errors = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::string bytes = original;
    for (int f = flips(rng); f > 0; --f) {
      size_t at = position(rng);
      bytes[at] = at < 8 ? static_cast<char>(rng()) : alphabet[pick(rng)];
    }
    write_bytes(path, bytes);
    try {
      auto loaded = load_safetensors(path);
      for (const auto& [name, t] : loaded.tensors) t.sum();  // touch the data
    } catch (const replica::Error&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 1000);  // most corruptions are detected
}


using replica::testing::error_in_child;

TEST_F(SafetensorsTest, AShapeNestedHalfAMillionDeepIsRefusedWithoutRecursing) {
  // Before: the header parsed, then formatting "shape entry [[[...]]] is not an integer"
  // overflowed the stack.
  const std::string deep = std::string(500000, '[') + std::string(500000, ']');
  const std::string path = raw_file(R"({"w":{"dtype":"F32","shape":[)" + deep + R"(],"data_offsets":[0,0]}})", 0);
  EXPECT_EQ(error_in_child([&] { load_safetensors(path); }),
            path + ": header JSON nested more than 128 levels deep");
}

TEST_F(SafetensorsTest, MessagesShowAnExcerptOfAnOffendingValue) {
  const std::string long_dtype(1 << 20, 'X');
  std::string message =
      load_error(raw_file(R"({"w":{"dtype":")" + long_dtype + R"(","shape":[1],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(message.find("tensor 'w': unsupported dtype 'XXXX"), std::string::npos) << message.substr(0, 300);
  EXPECT_LT(message.size(), 400u);
  message = load_error(raw_file(R"({"w":{"dtype":"F32","shape":[[1, 2, [3, [4, [5, [6]]]]]],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(message.find("shape entry [1, 2, [3, [4, [5, [...]]]]] is not an integer"), std::string::npos) << message;
}

TEST_F(SafetensorsTest, AFifoIsRefusedWithoutBlocking) {
  // Before: open() without O_NONBLOCK waited for a writer that never came.
  const std::string fifo = file("model.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_in_child([&] { load_safetensors(fifo); }),
            "'" + fifo + "' is a FIFO (named pipe), not a regular file: replica reads only regular files");
  EXPECT_NE(error_in_child([&] { replica::io::read_safetensors_header(fifo); }).find("FIFO"), std::string::npos);
}

TEST_F(SafetensorsTest, NonFiniteFloatingValuesAreRefusedNamingTheTensorAndTheFile) {
  const std::string path = file("weights.safetensors");
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16, torch::kFloat64}) {
    for (const double bad : {std::nan(""), double{INFINITY}, -double{INFINITY}}) {
      torch::Tensor w = torch::zeros({3, 5}, dtype);
      w[2][1] = bad;
      save_safetensors(path, {{"ok", torch::ones({2})}, {"model.w", w}, {"ids", torch::arange(3)}});
      const std::string what = std::isnan(bad) ? "NaN" : bad > 0 ? "+inf" : "-inf";
      EXPECT_EQ(load_error(path), path + ": tensor 'model.w' holds " + what +
                                      " at element 11 (of shape [3, 5]): replica refuses non-finite weights and state")
          << c10::toString(dtype);
      // Read bit for bit when asked to keep them.
      const auto kept = load_safetensors(path, replica::io::NonFinite::kKeep);
      EXPECT_TRUE(torch::equal(kept.at("model.w").isnan(), w.isnan()));
    }
  }
  // Past the first piece the check reads, too.
  torch::Tensor big = torch::zeros({(int64_t{1} << 22) + 7});
  big[(int64_t{1} << 22) + 3] = std::nan("");
  save_safetensors(path, {{"big", big}});
  EXPECT_NE(load_error(path).find("tensor 'big' holds NaN at element 4194307"), std::string::npos);
}

TEST_F(SafetensorsTest, TheHeaderAloneGivesNamesDtypesAndShapesInDataOrder) {
  const std::string path = file("h.safetensors");
  save_safetensors(path, {{"b", torch::zeros({2, 3}, torch::kBFloat16)}, {"a", torch::zeros({4}, torch::kInt64)}});
  const auto header = replica::io::read_safetensors_header(path);
  ASSERT_EQ(header.size(), 2u);
  EXPECT_EQ(header[0].name, "b");
  EXPECT_EQ(header[0].dtype, torch::kBFloat16);
  EXPECT_EQ(header[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(header[1].name, "a");
  EXPECT_EQ(header[1].shape, (std::vector<int64_t>{4}));
  // Checked as load_safetensors checks it: a lying offset is an error, nothing is allocated.
  const std::string bad = raw_file(R"({"w":{"dtype":"F32","shape":[1000000000000],"data_offsets":[0,4]}})", 4);
  try {
    replica::io::read_safetensors_header(bad);
    ADD_FAILURE() << "read without error";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("do not match shape [1000000000000]"), std::string::npos) << e.what();
  }
}

}  // namespace
