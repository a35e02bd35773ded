// The one mechanism for outside input (core/json.h, core/files.h): nesting bounded while
// parsing, only regular files read, sizes checked before anything is allocated.
#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

namespace replica {
namespace {

namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / (name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(BoundedJson, ADeeplyNestedArrayIsRefusedNamingTheSourceWithoutRecursing) {
  // 10^6 levels: a recursive parser, dump() or destructor would overflow the stack here.
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  const auto message = error_of([&] { parse_json(deep, "model/config.json"); });
  EXPECT_EQ(message, "model/config.json: JSON nested more than 128 levels deep");
  const auto ordered = error_of([&] { parse_ordered_json("{\"a\":" + deep + "}", "data.jsonl:3"); });
  EXPECT_EQ(ordered, "data.jsonl:3: JSON nested more than 128 levels deep");
}

TEST(BoundedJson, NestingUpToTheBoundParses) {
  const std::string ok = std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']');
  EXPECT_NO_THROW(parse_json(ok, "x"));
  const std::string over = "[" + ok + "]";
  EXPECT_NE(error_of([&] { parse_json(over, "x"); }).find("nested more than"), std::string::npos);
  EXPECT_EQ(parse_json("{\"a\": [1, {\"b\": 2}]}", "x")["a"][1]["b"], 2);
}

TEST(BoundedJson, InvalidJsonNamesTheSourceAndTheReasonBriefly) {
  const auto message = error_of([] { parse_json("{\"a\": ", "tokenizer.json"); });
  EXPECT_EQ(message.rfind("tokenizer.json: not valid JSON: parse error at line 1", 0), 0u) << message;
  EXPECT_LT(message.size(), 300u);
}

TEST(BoundedJson, AnExcerptIsShortAndShallowWhateverTheValue) {
  nlohmann::json deep = nlohmann::json::array();
  nlohmann::json* at = &deep;
  for (int i = 0; i < 100; ++i) {
    at->push_back(nlohmann::json::array());
    at = &(*at)[0];
  }
  EXPECT_EQ(json_excerpt(deep), "[[[[[...]]]]]");
  const auto long_string = json_excerpt(nlohmann::json(std::string(100000, 'x')), 20);
  EXPECT_EQ(long_string, "\"xxxxxxxxxxxxxxxxxxx...");
  EXPECT_EQ(json_excerpt(nlohmann::json{{"shape", {1, 2}}}), "{\"shape\": [1, 2]}");
}

TEST(RegularFiles, AFifoIsRefusedWithoutBlocking) {
  const auto dir = fresh_dir("replica-fifo");
  const auto fifo = (dir / "config.json").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { read_file(fifo); }),
            "'" + fifo + "' is a FIFO (named pipe), not a regular file: replica reads only regular files");
  EXPECT_NE(error_of([&] { require_regular_file(fifo); }).find("FIFO"), std::string::npos);
  fs::remove_all(dir);
}

TEST(RegularFiles, ASymlinkToADeviceOrADirectoryIsRefused) {
  const auto dir = fresh_dir("replica-dev");
  const auto link = dir / "config.json";
  fs::create_symlink("/dev/zero", link);
  EXPECT_NE(error_of([&] { read_file(link.string()); }).find("is a character device, not a regular file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_json_file(dir.string()); }).find("is a directory"), std::string::npos);
  fs::remove_all(dir);
}

TEST(RegularFiles, ASizeOverTheBoundIsRefusedBeforeReading) {
  const auto dir = fresh_dir("replica-size");
  const auto path = (dir / "big.json").string();
  std::ofstream(path) << std::string(1000, ' ');
  EXPECT_EQ(read_file(path, 1000).size(), 1000u);
  EXPECT_EQ(error_of([&] { read_file(path, 999); }),
            "'" + path + "' is 1000 bytes, more than the 999 bytes replica reads from such a file");
  RegularFile file(path);
  EXPECT_EQ(file.size(), 1000u);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace replica

#include "replica/core/text.h"

namespace replica {
namespace {

TEST(TextExcerpt, CutsAtACharacterBoundaryAndSaysSo) {
  EXPECT_EQ(excerpt("short"), "short");
  EXPECT_EQ(excerpt(std::string(100, 'k'), 10), "kkkkkkkkkk...");
  EXPECT_EQ(excerpt("aaaaaaaaa\xc3\xa9", 10), "aaaaaaaaa...");  // é not split
}

TEST(TextUtf8, FindsTheFirstByteThatIsNotWellFormed) {
  EXPECT_FALSE(invalid_utf8_offset("plain, caf\xc3\xa9, \xe2\x82\xac, \xf0\x9f\x98\x80"));
  EXPECT_EQ(invalid_utf8_offset("ab\x9d"), 2u);             // a lone continuation byte
  EXPECT_EQ(invalid_utf8_offset("a\xc0\xaf"), 1u);          // overlong
  EXPECT_EQ(invalid_utf8_offset("\xed\xa0\x80"), 0u);       // a surrogate
  EXPECT_EQ(invalid_utf8_offset("\xf4\x90\x80\x80"), 0u);   // past U+10FFFF
  EXPECT_EQ(invalid_utf8_offset("x\xe2\x82"), 1u);          // cut short
}

}  // namespace
}  // namespace replica
