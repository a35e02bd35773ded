// Hostile data files (issue 35): JSONL/CSV rows nested 10^6 deep or 100 MB long, data files and
// shards that are FIFOs or devices, MDS indexes whose counts and sizes claim terabytes, zstd
// shards that expand to 64 GiB, and shard basenames that lead outside the data directory.
//
// Each case runs in a forked child (run_in_child): a hang of the old code (a FIFO opened for
// reading) ends at the child's alarm instead of hanging the suite, a crash is reported as a
// signal, and the memory cases run under an address-space limit a little above what the
// process already maps, so "refused before allocating" is what is tested, not only the message.
#include "replica/core/error.h"
#include "replica/data/fashion_mnist.h"
#include "replica/data/mds.h"
#include "replica/data/records.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

namespace fs = std::filesystem;
using namespace replica::data;

namespace {

// How a child running one case ended: "error: MESSAGE" for a replica::Error, "other: ..." for
// any other exception, "ok" when nothing was thrown; `signal` when it was killed (its alarm
// after a hang, SIGSEGV for a stack overflow).
struct ChildOutcome {
  std::string text;
  int signal = 0;
};

std::ostream& operator<<(std::ostream& os, const ChildOutcome& o) {
  return os << (o.signal ? "killed by signal " + std::to_string(o.signal) + " " : std::string()) << o.text;
}

uint64_t mapped_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  }
  return 0;
}

// Runs `body` in a forked child that is killed after `seconds`, with its address space limited
// to what the process maps now plus `extra_bytes` (0: no limit).
ChildOutcome run_in_child(const std::function<void()>& body, unsigned seconds = 30, uint64_t extra_bytes = 0) {
  int fds[2];
  if (::pipe(fds) != 0) return {"pipe failed", 0};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::alarm(seconds);
    if (extra_bytes > 0) {
      const rlimit limit{mapped_bytes() + extra_bytes, mapped_bytes() + extra_bytes};
      ::setrlimit(RLIMIT_AS, &limit);
    }
    std::string text;
    try {
      body();
      text = "ok";
    } catch (const replica::Error& e) {
      text = std::string("error: ") + e.what();
    } catch (const std::exception& e) {
      text = std::string("other: ") + e.what();
    }
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fds[1], text.data() + done, text.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  ChildOutcome outcome;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    outcome.text.append(buffer, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) outcome.signal = WTERMSIG(status);
  return outcome;
}

// The child ended with a replica::Error whose message holds every needle.
void expect_refusal(const ChildOutcome& outcome, std::initializer_list<std::string> needles) {
  EXPECT_EQ(outcome.signal, 0) << outcome;
  ASSERT_EQ(outcome.text.rfind("error: ", 0), 0u) << outcome;
  for (const auto& needle : needles) EXPECT_NE(outcome.text.find(needle), std::string::npos) << needle << "\n" << outcome;
  EXPECT_EQ(outcome.text.find('\n'), std::string::npos) << "one line: " << outcome;
}

constexpr uint64_t kMiB = uint64_t{1} << 20;

class HostileData : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("replica_hostile_{}_{}", ::getpid(),
                                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
  }
  // An MDS data set of three samples (id: int64, text: str) in dir_/NAME.
  fs::path write_mds(const std::string& name, const std::string& compression = "") {
    const fs::path out = dir_ / name;
    MdsWriter w(out.string(), {{"id", "int64"}, {"text", "str"}}, {compression, int64_t{1} << 26});
    for (int64_t i = 0; i < 3; ++i) w.write({{"id", i}, {"text", std::string("row ") + std::to_string(i)}});
    w.finish();
    return out;
  }
  nlohmann::json read_index(const fs::path& ds) {
    std::ifstream in(ds / "index.json");
    return nlohmann::json::parse(in);
  }
  void write_index(const fs::path& ds, const nlohmann::json& index) { write(ds / "index.json", index.dump()); }
  // Opens the data set and reads every sample, in a child.
  ChildOutcome open_and_read(const fs::path& ds, uint64_t extra_bytes = 0) {
    return run_in_child(
        [&] {
          MdsDataset d(ds.string());
          for (int64_t i = 0; i < d.size(); ++i) (void)d.get(i);
        },
        30, extra_bytes);
  }

  fs::path dir_;
};

std::string nested_list(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// A zstd frame of `blocks` RLE blocks, each 128 KiB of zeros in 4 bytes, so a 2 MiB file
// decompresses to 64 GiB; with or without the content size in its header.
std::string rle_zstd_frame(uint64_t blocks, bool declare_size) {
  std::string frame = {'\x28', '\xb5', '\x2f', '\xfd'};  // magic
  frame.push_back(declare_size ? '\xc0' : '\x00');       // 8-byte content size or none; not single-segment
  frame.push_back('\x38');                               // window: 2^(10 + 7) = 128 KiB
  const uint64_t size = blocks << 17;
  if (declare_size) {
    for (int i = 0; i < 8; ++i) frame.push_back(static_cast<char>(size >> (8 * i)));
  }
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint32_t header = (b + 1 == blocks ? 1u : 0u) | (1u << 1) | ((uint32_t{1} << 17) << 3);  // last, RLE, size
    frame.push_back(static_cast<char>(header & 0xff));
    frame.push_back(static_cast<char>((header >> 8) & 0xff));
    frame.push_back(static_cast<char>((header >> 16) & 0xff));
    frame.push_back('\0');
  }
  return frame;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// JSONL / CSV records

TEST_F(HostileData, DeeplyNestedRowsAreRefusedNamingFileAndLine) {
  write(dir_ / "deep.jsonl", "{\"text\": \"fine\"}\n{\"messages\": " + nested_list(1000000) + "}\n");
  expect_refusal(run_in_child([&] { read_records((dir_ / "deep.jsonl").string()); }),
                 {"deep.jsonl:2: JSON nested more than 128 levels deep"});
  // A CSV cell holding JSON goes through the same parser.
  write(dir_ / "deep.csv", "text,messages\nfine," + nested_list(1000000) + "\n");
  expect_refusal(run_in_child([&] { read_records((dir_ / "deep.csv").string()); }),
                 {"deep.csv:2: column 'messages': JSON nested more than 128 levels deep"});
  // Nesting within the bound is data as before, and text that only looks like JSON stays text.
  write(dir_ / "ok.csv", "a,b\n" + nested_list(100) + ",[not json\n");
  const auto records = read_records((dir_ / "ok.csv").string());
  ASSERT_EQ(records.size(), 1u);
  EXPECT_TRUE(records[0]["a"].is_array());
  EXPECT_EQ(records[0]["b"], "[not json");
}

TEST_F(HostileData, OverlongRowsAreRefusedWhileBeingRead) {
  // 100 MB on one line: refused after kMaxRecordBytes, under an address-space limit that the
  // old std::getline + parse (some 300 MB for this line) does not fit in.
  write(dir_ / "long.jsonl", "{\"text\": \"" + std::string(100 * kMiB, 'a') + "\"}\n");
  expect_refusal(run_in_child([&] { read_records((dir_ / "long.jsonl").string()); }, 60, 128 * kMiB),
                 {"long.jsonl:1: the line is longer than 16 MiB"});
  write(dir_ / "long.csv", "text\n\"" + std::string(kMaxRecordBytes + 10, 'b') + "\"\n");
  expect_refusal(run_in_child([&] { read_records((dir_ / "long.csv").string()); }, 60, 128 * kMiB),
                 {"long.csv:2: the row is longer than 16 MiB"});
  // A row just under the bound is read.
  write(dir_ / "fits.jsonl", "{\"text\": \"" + std::string(kMaxRecordBytes - 20, 'c') + "\"}\n{\"text\": \"d\"}\n");
  EXPECT_EQ(read_records((dir_ / "fits.jsonl").string()).size(), 2u);
}

TEST_F(HostileData, DataFilesMustBeRegularFiles) {
  const fs::path fifo_dir = dir_ / "fifo";
  fs::create_directories(fifo_dir);
  ASSERT_EQ(::mkfifo((fifo_dir / "train.jsonl").c_str(), 0600), 0);
  ASSERT_EQ(::mkfifo((dir_ / "data.csv").c_str(), 0600), 0);
  // No writer ever opens these FIFOs: a reader that opened one would wait forever (the
  // child's alarm ends it and the test fails on the signal).
  expect_refusal(run_in_child([&] { read_records(fifo_dir.string()); }, 20),
                 {"fifo/train.jsonl' is a FIFO (named pipe), not a regular file"});
  expect_refusal(run_in_child([&] { read_records((dir_ / "data.csv").string()); }, 20),
                 {"data.csv' is a FIFO (named pipe), not a regular file"});
  // A symlink to /dev/zero (endless bytes) is refused as what it is, not read.
  const fs::path zero_dir = dir_ / "zero";
  fs::create_directories(zero_dir);
  fs::create_symlink("/dev/zero", zero_dir / "train.jsonl");
  expect_refusal(run_in_child([&] { read_records(zero_dir.string()); }, 20),
                 {"zero/train.jsonl' is a character device, not a regular file"});
  // Fashion-MNIST's idx files go through the same check.
  const fs::path idx_dir = dir_ / "idx";
  fs::create_directories(idx_dir);
  ASSERT_EQ(::mkfifo((idx_dir / "train-images-idx3-ubyte").c_str(), 0600), 0);
  write(idx_dir / "train-labels-idx1-ubyte", "");
  expect_refusal(run_in_child([&] { load_fashion_mnist(idx_dir.string(), "train"); }, 20),
                 {"idx/train-images-idx3-ubyte' is a FIFO (named pipe), not a regular file"});
}

// ---------------------------------------------------------------------------------------
// MDS

TEST_F(HostileData, MdsCountsAndSizesAreCheckedAgainstTheShardFiles) {
  const fs::path ds = write_mds("ds");
  const nlohmann::json good = read_index(ds);
  const auto shard_length = fs::file_size(ds / "shard.00000.mds");
  auto with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json index = good;
    change(index["shards"][0]);
    write_index(ds, index);
    return open_and_read(ds, 512 * kMiB);
  };
  expect_refusal(with([](auto& s) { s["samples"] = 1000000000000; }),
                 {"index.json: shard 0: 'samples' is 1000000000000", "shard.00000.mds", std::to_string(shard_length)});
  expect_refusal(with([](auto& s) { s["samples"] = 1e12; }), {"shard 0: 'samples' must be a non-negative integer"});
  expect_refusal(with([](auto& s) { s["samples"] = -1; }), {"shard 0: 'samples' must be a non-negative integer"});
  expect_refusal(with([](auto& s) { s["raw_data"]["bytes"] = 1000000000000000; }),
                 {"shard 0: 'raw_data.bytes' is 1000000000000000, more than 4294967295"});
  expect_refusal(with([&](auto& s) { s["raw_data"]["bytes"] = shard_length + 1; }),
                 {"shard 0: 'raw_data.bytes' is " + std::to_string(shard_length + 1), "shard.00000.mds' is"});
  expect_refusal(with([](auto& s) { s["column_sizes"] = {1000000000000, nullptr}; }),
                 {"shard 0: 'column_sizes' gives column \"id\" (int64) size 1000000000000, its encoding has 8"});
  expect_refusal(with([](auto& s) { s["size_limit"] = -5; }), {"shard 0: 'size_limit' must be a positive integer"});
  expect_refusal(with([](auto& s) {
                   s["column_encodings"][1] = "ndarray:uint8:100000,100000,100000";
                   s.erase("column_sizes");
                 }),
                 {"shard 0: column \"text\" has unsupported encoding \"ndarray:uint8:100000,100000,100000\""});
  // The unchanged index still reads.
  write_index(ds, good);
  EXPECT_EQ(open_and_read(ds).text, "ok");
}

TEST_F(HostileData, MdsSampleOffsetsAreCheckedBeforeTheSampleIsRead) {
  const fs::path ds = write_mds("ds");
  const fs::path shard = ds / "shard.00000.mds";
  std::string bytes = replica::testing::read_file(shard);
  const uint32_t far = 0xfffffff0u;
  std::memcpy(bytes.data() + 8, &far, 4);  // offsets[1]: the end of sample 0
  write(shard, bytes);
  expect_refusal(open_and_read(ds, 512 * kMiB),
                 {"shard.00000.mds': sample 0 (offsets", "4294967280) lies outside the file's"});
}

TEST_F(HostileData, ZstdShardsNeverExpandPastRawDataBytes) {
  const fs::path ds = write_mds("ds", "zstd");
  const nlohmann::json good = read_index(ds);
  const uint64_t raw_bytes = good["shards"][0]["raw_data"]["bytes"].get<uint64_t>();
  const fs::path zip = ds / "shard.00000.mds.zstd";
  auto with_frame = [&](const std::string& frame) {
    write(zip, frame);
    nlohmann::json index = good;
    index["shards"][0]["zip_data"]["bytes"] = frame.size();
    write_index(ds, index);
    return open_and_read(ds, 512 * kMiB);
  };
  // 64 GiB of zeros in a 2 MiB file, the size in its header: refused before allocating.
  const uint64_t blocks_64gib = (uint64_t{64} << 30) >> 17;
  expect_refusal(with_frame(rle_zstd_frame(blocks_64gib, true)),
                 {"shard.00000.mds.zstd' declares 68719476736 decompressed bytes, but index.json's raw_data.bytes says " +
                  std::to_string(raw_bytes)});
  // The same without a size in the header: decompression stops at raw_data.bytes.
  expect_refusal(with_frame(rle_zstd_frame(blocks_64gib, false)),
                 {"shard.00000.mds.zstd' decompresses to more than the " + std::to_string(raw_bytes) +
                  " bytes index.json's raw_data.bytes says"});
  // An index that claims a 64 GiB shard is refused when opened.
  nlohmann::json index = good;
  index["shards"][0]["raw_data"]["bytes"] = uint64_t{64} << 30;
  write_index(ds, index);
  write(zip, rle_zstd_frame(1, true));
  index["shards"][0]["zip_data"]["bytes"] = fs::file_size(zip);
  write_index(ds, index);
  expect_refusal(open_and_read(ds, 512 * kMiB), {"shard 0: 'raw_data.bytes' is 68719476736, more than 4294967295"});
}

TEST_F(HostileData, MdsShardsOutsideTheDataDirectoryAreRefused) {
  write_mds("outside");
  const fs::path ds = write_mds("ds");
  const nlohmann::json good = read_index(ds);
  fs::remove(ds / "shard.00000.mds");
  auto with_basename = [&](const char* key, const std::string& basename) {
    nlohmann::json index = good;
    auto& shard = index["shards"][0];
    if (std::string(key) == "zip_data") {
      shard["zip_data"] = shard["raw_data"];
      shard["compression"] = "zstd";
    }
    shard[key]["basename"] = basename;
    write_index(ds, index);
    return open_and_read(ds);
  };
  expect_refusal(with_basename("raw_data", "../outside/shard.00000.mds"),
                 {"ds/index.json: shard 0: raw_data.basename \"../outside/shard.00000.mds\" is outside the data directory"});
  expect_refusal(with_basename("raw_data", (dir_ / "outside" / "shard.00000.mds").string()),
                 {"ds/index.json: shard 0: raw_data.basename", "is outside the data directory"});
  expect_refusal(with_basename("zip_data", "../outside/shard.00000.mds"),
                 {"ds/index.json: shard 0: zip_data.basename \"../outside/shard.00000.mds\" is outside the data directory"});
  // A symlink in the data directory that leads out of it.
  fs::create_symlink(dir_ / "outside" / "shard.00000.mds", ds / "shard.00000.mds");
  expect_refusal(with_basename("raw_data", "shard.00000.mds"),
                 {"ds/index.json: shard 0: raw_data.basename \"shard.00000.mds\" resolves to", "outside the data directory"});
  // A subdirectory inside it (streaming's merge_index writes such basenames) is fine.
  fs::remove(ds / "shard.00000.mds");
  fs::create_directories(ds / "part0");
  fs::copy_file(dir_ / "outside" / "shard.00000.mds", ds / "part0" / "shard.00000.mds");
  EXPECT_EQ(with_basename("raw_data", "part0/shard.00000.mds").text, "ok");
}

TEST_F(HostileData, MdsShardsMustBeRegularFiles) {
  const fs::path ds = write_mds("ds");
  fs::remove(ds / "shard.00000.mds");
  ASSERT_EQ(::mkfifo((ds / "shard.00000.mds").c_str(), 0600), 0);
  // Nothing ever writes to the FIFO: opening it for reading would wait forever (the child's
  // alarm ends such a run and the test fails on the signal).
  expect_refusal(open_and_read(ds), {"ds/index.json: shard 0:", "shard.00000.mds' is a FIFO (named pipe), not a regular file"});
  const fs::path zipped = write_mds("zipped", "zstd");
  fs::remove(zipped / "shard.00000.mds.zstd");
  ASSERT_EQ(::mkfifo((zipped / "shard.00000.mds.zstd").c_str(), 0600), 0);
  expect_refusal(open_and_read(zipped), {"shard.00000.mds.zstd' is a FIFO (named pipe), not a regular file"});
  fs::remove(ds / "index.json");
  ASSERT_EQ(::mkfifo((ds / "index.json").c_str(), 0600), 0);
  expect_refusal(open_and_read(ds), {"index.json' is a FIFO (named pipe), not a regular file"});
}

// The CLI prints the one line and exits non-zero.
TEST_F(HostileData, MdsConvertRefusesHostileRecordsInOneLine) {
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  auto convert = [&](const fs::path& input) {
    return replica::testing::run_program(REPLICA_BIN,
                                         {"mds", "convert", "--input", input.string(), "--out",
                                          (dir_ / "out").string(), "--columns", "text:str"},
                                         {}, std::chrono::seconds(60));
  };
  write(dir_ / "deep.jsonl", "{\"text\": " + nested_list(1000000) + "}\n");
  ASSERT_EQ(::mkfifo((dir_ / "fifo.jsonl").c_str(), 0600), 0);
  write(dir_ / "long.jsonl", "{\"text\": \"" + std::string(kMaxRecordBytes + 1, 'x') + "\"}\n");
  for (const auto& [file, needle] : {std::pair{"deep.jsonl", "deep.jsonl:1: JSON nested more than 128 levels deep"},
                                     std::pair{"fifo.jsonl", "fifo.jsonl' is a FIFO (named pipe)"},
                                     std::pair{"long.jsonl", "long.jsonl:1: the line is longer than 16 MiB"}}) {
    const auto r = convert(dir_ / file);
    EXPECT_FALSE(r.timed_out) << r;
    EXPECT_NE(r.exit_code, 0) << r;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r;
  }
}
