// Event files are read back the way TensorBoard reads them: TFRecord framing (length, masked
// CRC32C of the length, payload, masked CRC32C of the payload), then the Event/Summary protos.
#include "replica/obs/tensorboard.h"
#include "replica/obs/tests/event_file_reader.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;
using namespace replica::obs;
using namespace replica::testing;


TEST(Crc32c, MatchesTheStandardCheckValues) {
  // RFC 3720 B.4 and the CRC catalogue's check value for CRC-32C.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  const std::string ones(32, '\xff');
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(crc32c("", 0), 0u);
}

TEST(Crc32c, MaskIsTensorFlows) {
  const uint32_t crc = crc32c("abc", 3);
  EXPECT_EQ(masked_crc32c("abc", 3), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

TEST(EventFileWriter, WritesScalarsThatParseBack) {
  const fs::path dir = fs::temp_directory_path() / ("replica-tb-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string path;
  {
    EventFileWriter w(dir.string());
    path = w.path();
    w.add_scalar("train/loss", 2.5, 10);
    w.add_scalar("train/learning_rate", 1e-3, 10);
    w.add_scalar("train/loss", 0.125, 20);
    w.add_scalar("eval/accuracy", 0.875, 1234567890123LL);
    w.flush();
  }
  EXPECT_EQ(fs::path(path).parent_path(), dir);
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u);
  const auto records = read_records(path);
  ASSERT_EQ(records.size(), 5u);

  // The first event names the format version, as TensorFlow's writers do.
  auto header = parse_message(records[0]);
  bool version = false;
  for (const auto& f : header) {
    if (f.number == 3) version = f.bytes == "brain.Event:2";
  }
  EXPECT_TRUE(version);

  const std::vector<Scalar> expected = {{0, 10, "train/loss", 2.5f},
                                        {0, 10, "train/learning_rate", 1e-3f},
                                        {0, 20, "train/loss", 0.125f},
                                        {0, 1234567890123LL, "eval/accuracy", 0.875f}};
  for (size_t i = 0; i < expected.size(); ++i) {
    const Scalar got = decode_scalar(records[i + 1]);
    EXPECT_EQ(got.tag, expected[i].tag);
    EXPECT_EQ(got.step, expected[i].step);
    EXPECT_EQ(got.value, expected[i].value);
    EXPECT_GT(got.wall_time, 1.6e9);  // seconds since the epoch, as TensorBoard expects
  }
  fs::remove_all(dir);
}

TEST(EventFileWriter, UnwritableDirectoryIsAnErrorNamingIt) {
  try {
    EventFileWriter w("/proc/replica-cannot-write-here");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/replica-cannot-write-here"), std::string::npos) << e.what();
  }
}
