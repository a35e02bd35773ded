#include "replica/data/fashion_mnist.h"

#include "replica/core/error.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using replica::data::ImageDataset;
using replica::data::kFashionMnistDir;
using replica::data::load_fashion_mnist;
using replica::data::make_batch;

namespace {

bool have_real_data() {
  return fs::exists(fs::path(kFashionMnistDir) / "train-images-idx3-ubyte.gz");
}

// Loads once per process: the real train split is 47 MB and several tests share it.
const ImageDataset& real_split(const std::string& split) {
  static const ImageDataset train = load_fashion_mnist(kFashionMnistDir, "train");
  static const ImageDataset t10k = load_fashion_mnist(kFashionMnistDir, "t10k");
  return split == "train" ? train : t10k;
}

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "replica-data-test-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code error;
    fs::remove_all(path_, error);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void put_u32(std::vector<uint8_t>& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(value >> shift));
}

std::vector<uint8_t> images_file(uint32_t magic, uint32_t count, uint32_t rows, uint32_t cols,
                                 size_t pixel_bytes) {
  std::vector<uint8_t> out;
  put_u32(out, magic);
  put_u32(out, count);
  put_u32(out, rows);
  put_u32(out, cols);
  for (size_t i = 0; i < pixel_bytes; ++i) out.push_back(static_cast<uint8_t>(i * 7));
  return out;
}

std::vector<uint8_t> labels_file(uint32_t magic, uint32_t count, std::vector<uint8_t> labels) {
  std::vector<uint8_t> out;
  put_u32(out, magic);
  put_u32(out, count);
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

void write_raw(const fs::path& path, const std::vector<uint8_t>& bytes) {
  std::ofstream file(path, std::ios::binary);
  file.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void write_gz(const fs::path& path, const std::vector<uint8_t>& bytes) {
  gzFile file = gzopen(path.string().c_str(), "wb");
  ASSERT_NE(file, nullptr);
  ASSERT_EQ(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(file), Z_OK);
}

std::vector<uint8_t> read_all(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(file), {});
}

// A valid 5-image 4x3 split "tiny" (gzip-compressed).
void write_tiny_split(const fs::path& dir) {
  write_gz(dir / "tiny-images-idx3-ubyte.gz", images_file(0x803, 5, 4, 3, 5 * 4 * 3));
  write_gz(dir / "tiny-labels-idx1-ubyte.gz", labels_file(0x801, 5, {0, 9, 3, 3, 1}));
}

// Runs `body`, expecting a replica::Error whose message contains every part of `needles`.
template <typename Body>
void expect_error(Body body, const std::vector<std::string>& needles) {
  try {
    body();
    ADD_FAILURE() << "no replica::Error thrown";
  } catch (const replica::Error& error) {
    const std::string message = error.what();
    for (const auto& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message \"" << message << "\" lacks \"" << needle << "\"";
    }
  }
}

}  // namespace

TEST(FashionMnist, LoadsRealTrainAndTestSplits) {
  ASSERT_TRUE(have_real_data()) << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  const auto start = std::chrono::steady_clock::now();
  const ImageDataset& train = real_split("train");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  RecordProperty("train_and_t10k_load_seconds", std::to_string(seconds));
  std::printf("train + t10k loaded in %.3f s\n", seconds);

  EXPECT_EQ(train.images.sizes(), (std::vector<int64_t>{60000, 28, 28}));
  EXPECT_EQ(train.images.scalar_type(), torch::kUInt8);
  EXPECT_EQ(train.labels.sizes(), (std::vector<int64_t>{60000}));
  EXPECT_EQ(train.labels.scalar_type(), torch::kInt64);
  EXPECT_EQ(train.size(), 60000);

  const ImageDataset& test = real_split("t10k");
  EXPECT_EQ(test.images.sizes(), (std::vector<int64_t>{10000, 28, 28}));
  EXPECT_EQ(test.labels.sizes(), (std::vector<int64_t>{10000}));
}

TEST(FashionMnist, RealLabelsAreBalancedOverTenClasses) {
  ASSERT_TRUE(have_real_data()) << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  // Fashion-MNIST is exactly balanced: 6000 per class in train, 1000 in t10k.
  const torch::Tensor train_counts = torch::bincount(real_split("train").labels, {}, 10);
  const torch::Tensor test_counts = torch::bincount(real_split("t10k").labels, {}, 10);
  ASSERT_EQ(train_counts.numel(), 10);
  for (int c = 0; c < 10; ++c) {
    EXPECT_EQ(train_counts[c].item<int64_t>(), 6000) << "class " << c;
    EXPECT_EQ(test_counts[c].item<int64_t>(), 1000) << "class " << c;
  }
  // Known first labels of the train split (ankle boot, T-shirt, T-shirt, dress, T-shirt).
  EXPECT_TRUE(real_split("train").labels.slice(0, 0, 5).equal(
      torch::tensor({9, 0, 0, 3, 0}, torch::kInt64)));
}

TEST(FashionMnist, RealImagesAreNotBlank) {
  ASSERT_TRUE(have_real_data()) << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  const torch::Tensor& images = real_split("train").images;
  EXPECT_EQ(images.max().item<int>(), 255);
  EXPECT_EQ(images.min().item<int>(), 0);
  // Every image has some ink.
  EXPECT_TRUE(images.flatten(1).amax(1).gt(0).all().item<bool>());
}

TEST(FashionMnist, MakeBatchScalesAndSelectsRows) {
  ASSERT_TRUE(have_real_data()) << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  const ImageDataset& train = real_split("train");
  const torch::Tensor rows = torch::tensor({59999, 0, 17}, torch::kInt64);
  auto [images, labels] = make_batch(train, rows);
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{3, 1, 28, 28}));
  EXPECT_EQ(images.scalar_type(), torch::kFloat32);
  EXPECT_GE(images.min().item<float>(), 0.0f);
  EXPECT_LE(images.max().item<float>(), 1.0f);
  EXPECT_TRUE(torch::allclose(images[1][0] * 255.0, train.images[0].to(torch::kFloat32)));
  EXPECT_TRUE(labels.equal(train.labels.index_select(0, rows)));
}

TEST(FashionMnist, MakeBatchRejectsBadIndices) {
  TempDir dir;
  write_tiny_split(dir.path());
  const ImageDataset tiny = load_fashion_mnist(dir.path().string(), "tiny");
  expect_error([&] { make_batch(tiny, torch::tensor({0, 5}, torch::kInt64)); }, {"index 5", "5 samples"});
  expect_error([&] { make_batch(tiny, torch::tensor({-1}, torch::kInt64)); }, {"index -1"});
  expect_error([&] { make_batch(tiny, torch::tensor({0.5})); }, {"integer"});
  auto [images, labels] = make_batch(tiny, torch::empty({0}, torch::kInt64));
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{0, 1, 4, 3}));
  EXPECT_EQ(labels.numel(), 0);
}

TEST(FashionMnist, ReadsGzipAndUncompressedFiles) {
  TempDir dir;
  write_tiny_split(dir.path());
  const ImageDataset tiny = load_fashion_mnist(dir.path().string(), "tiny");
  EXPECT_EQ(tiny.images.sizes(), (std::vector<int64_t>{5, 4, 3}));
  EXPECT_TRUE(tiny.labels.equal(torch::tensor({0, 9, 3, 3, 1}, torch::kInt64)));
  EXPECT_EQ(tiny.images[1][0][0].item<int>(), static_cast<uint8_t>(12 * 7));

  // Same bytes without compression and without the .gz suffix.
  write_raw(dir.path() / "plain-images-idx3-ubyte", images_file(0x803, 5, 4, 3, 60));
  write_raw(dir.path() / "plain-labels-idx1-ubyte", labels_file(0x801, 5, {0, 9, 3, 3, 1}));
  const ImageDataset plain = load_fashion_mnist(dir.path().string(), "plain");
  EXPECT_TRUE(plain.images.equal(tiny.images));
  EXPECT_TRUE(plain.labels.equal(tiny.labels));
}

TEST(FashionMnist, MissingDirectoryOrSplitNamesThePath) {
  TempDir dir;
  const std::string missing = (dir.path() / "nowhere").string();
  expect_error([&] { load_fashion_mnist(missing, "train"); }, {missing});

  write_tiny_split(dir.path());
  write_raw(dir.path() / "other-images-idx3-ubyte", images_file(0x803, 0, 1, 1, 0));
  const std::string expected_file = (dir.path() / "t10k-images-idx3-ubyte").string() + "[.gz]";
  expect_error([&] { load_fashion_mnist(dir.path().string(), "t10k"); },
               {"fashion-mnist: no file " + expected_file + " (split 't10k'", "other, tiny"});

  // Images present but labels missing: names the labels file.
  write_raw(dir.path() / "lonely-images-idx3-ubyte", images_file(0x803, 1, 1, 1, 1));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "lonely"); },
               {(dir.path() / "lonely-labels-idx1-ubyte").string() + "[.gz]"});
}

TEST(FashionMnist, BadMagicNamesTheFile) {
  TempDir dir;
  write_tiny_split(dir.path());
  const fs::path images = dir.path() / "tiny-images-idx3-ubyte.gz";
  write_gz(images, images_file(0x801, 5, 4, 3, 60));  // a labels magic in an images file
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {images.string(), "magic", "0x00000801", "0x00000803"});

  write_tiny_split(dir.path());
  const fs::path labels = dir.path() / "tiny-labels-idx1-ubyte.gz";
  write_gz(labels, labels_file(0x08030000, 5, {0, 1, 2, 3, 4}));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); }, {labels.string(), "magic"});
}

TEST(FashionMnist, TruncatedDataNamesTheFile) {
  TempDir dir;
  write_tiny_split(dir.path());
  const fs::path images = dir.path() / "tiny-images-idx3-ubyte.gz";

  // Header promises 5 images, data holds 4.5.
  write_gz(images, images_file(0x803, 5, 4, 3, 54));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {images.string(), "truncated", "54 of the 60"});

  // Header itself cut short.
  write_gz(images, std::vector<uint8_t>{0, 0, 8, 3, 0, 0});
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {images.string(), "truncated", "header"});

  // A valid gzip file cut off mid-stream (as an interrupted download leaves it).
  write_gz(images, images_file(0x803, 5, 4, 3, 60));
  std::vector<uint8_t> bytes = read_all(images);
  bytes.resize(bytes.size() - 12);
  write_raw(images, bytes);
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {images.string(), "truncated"});

  // Uncompressed and cut short.
  fs::remove(images);
  write_raw(dir.path() / "tiny-images-idx3-ubyte", images_file(0x803, 5, 4, 3, 59));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {(dir.path() / "tiny-images-idx3-ubyte").string(), "truncated"});
}

TEST(FashionMnist, CorruptGzipNamesTheFile) {
  TempDir dir;
  write_tiny_split(dir.path());
  const fs::path images = dir.path() / "tiny-images-idx3-ubyte.gz";
  std::vector<uint8_t> bytes = read_all(images);
  bytes[bytes.size() - 6] ^= 0xff;  // inside the CRC-32 trailer
  write_raw(images, bytes);
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {images.string(), "corrupt"});
}

TEST(FashionMnist, TrailingDataNamesTheFile) {
  TempDir dir;
  write_tiny_split(dir.path());
  const fs::path labels = dir.path() / "tiny-labels-idx1-ubyte.gz";
  write_gz(labels, labels_file(0x801, 5, {0, 1, 2, 3, 4, 5}));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {labels.string(), "after the 5 bytes"});
}

TEST(FashionMnist, CountMismatchNamesBothFiles) {
  TempDir dir;
  write_tiny_split(dir.path());
  const fs::path labels = dir.path() / "tiny-labels-idx1-ubyte.gz";
  write_gz(labels, labels_file(0x801, 4, {0, 1, 2, 3}));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {(dir.path() / "tiny-images-idx3-ubyte.gz").string(), "5 images",
                labels.string(), "4 labels"});
}

TEST(FashionMnist, LabelOutOfRangeNamesTheFile) {
  TempDir dir;
  write_tiny_split(dir.path());
  const fs::path labels = dir.path() / "tiny-labels-idx1-ubyte.gz";
  write_gz(labels, labels_file(0x801, 5, {0, 1, 10, 3, 4}));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {labels.string(), "label 10 at index 2"});
}

TEST(FashionMnist, AbsurdHeaderIsRejectedBeforeAllocating) {
  TempDir dir;
  write_tiny_split(dir.path());
  const fs::path images = dir.path() / "tiny-images-idx3-ubyte.gz";
  write_gz(images, images_file(0x803, 0xffffffffu, 0xffff, 0xffff, 0));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {images.string(), "more than this reader accepts"});
  write_gz(images, images_file(0x803, 5, 0, 3, 0));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {images.string(), "0x3 pixels"});
}

// Found by fuzz/fuzz_idx: a header within the reader's limits (here 1 GiB of pixels) in a
// file of a few bytes was allocated for before the data ran out. Now refused up front.
TEST(FashionMnist, HeaderAnnouncingMoreThanTheFileCanHoldIsRejectedBeforeAllocating) {
  TempDir dir;
  write_tiny_split(dir.path());
  const fs::path images = dir.path() / "tiny-images-idx3-ubyte";
  fs::remove(dir.path() / "tiny-images-idx3-ubyte.gz");
  write_raw(images, images_file(0x803, 1u << 14, 256, 256, 3));
  expect_error([&] { load_fashion_mnist(dir.path().string(), "tiny"); },
               {images.string(), "truncated", "1073741824 data bytes", "more than a 19 byte file can hold"});
}
