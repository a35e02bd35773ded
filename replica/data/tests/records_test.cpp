#include "replica/data/records.h"

#include "replica/core/error.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace {
fs::path temp_dir() {
  auto d = fs::temp_directory_path() / ("records_test_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}
void write(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }
}  // namespace

TEST(Records, JsonlFileAndDirectoryWithSplit) {
  auto d = temp_dir();
  write(d / "train.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"b\", \"n\": 2}\n");
  auto r = replica::data::read_records(d.string(), "train");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[1]["text"], "b");
  EXPECT_EQ(replica::data::read_records((d / "train.jsonl").string()).size(), 2u);
  fs::remove_all(d);
}

// Blank lines are skipped but counted, and a CSV row that spans lines starts where its quote
// opens: each record carries the line an error about one of its values must name.
TEST(Records, NumberedRecordsCarryTheirFileLine) {
  auto d = temp_dir();
  write(d / "train.jsonl", "{\"n\": 1}\n\n\n{\"n\": 2}\n");
  auto r = replica::data::read_numbered_records(d.string(), "train");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].line, 1u);
  EXPECT_EQ(r[1].line, 4u);
  EXPECT_EQ(r[1].value["n"], 2);
  write(d / "valid.csv", "a,b\n\"x\ny\",1\n2,3\n");
  auto c = replica::data::read_numbered_records(d.string(), "valid");
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].line, 2u);
  EXPECT_EQ(c[1].line, 4u);
  fs::remove_all(d);
}

TEST(Records, CsvWithQuotesNewlinesAndJsonCells) {
  auto d = temp_dir();
  write(d / "train.csv",
        "prompt,completion,messages\r\n\"Say \"\"hi\"\"\",\"line1\nline2\",\"[{\"\"role\"\":\"\"user\"\",\"\"content\"\":\"\"x\"\"}]\"\r\n"
        "p2,c2,\r\n");
  auto r = replica::data::read_records(d.string(), "train");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0]["prompt"], "Say \"hi\"");
  EXPECT_EQ(r[0]["completion"], "line1\nline2");
  ASSERT_TRUE(r[0]["messages"].is_array());
  EXPECT_EQ(r[0]["messages"][0]["role"], "user");
  EXPECT_EQ(r[1]["messages"], "");
  fs::remove_all(d);
}

TEST(Records, ErrorsNameFileAndLine) {
  auto d = temp_dir();
  write(d / "bad.jsonl", "{\"text\": \"a\"}\n[1, 2]\n");
  try {
    replica::data::read_records((d / "bad.jsonl").string());
    FAIL();
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:2"), std::string::npos) << e.what();
  }
  write(d / "bad2.jsonl", "{\"text\": \"a\"\n");
  EXPECT_THROW(replica::data::read_records((d / "bad2.jsonl").string()), replica::Error);
  write(d / "bad.csv", "a,b\n1,2\n3\n");
  try {
    replica::data::read_records((d / "bad.csv").string());
    FAIL();
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.csv:3"), std::string::npos) << e.what();
  }
  write(d / "open.csv", "a\n\"never closed\n");
  EXPECT_THROW(replica::data::read_records((d / "open.csv").string()), replica::Error);
  EXPECT_THROW(replica::data::read_records((d / "nope").string()), replica::Error);
  EXPECT_THROW(replica::data::read_records(d.string(), "valid"), replica::Error);
  fs::remove_all(d);
}

// Found by fuzz/fuzz_records: a number too large for a double is nlohmann's out_of_range,
// not a parse_error; it must still be an error naming the file and line, not a crash.
TEST(Records, NumberOutOfRangeIsAnErrorNamingTheLine) {
  auto d = temp_dir();
  write(d / "huge.jsonl", "{\"text\": \"a\"}\n{\"x\": 1e999}\n");
  try {
    replica::data::read_records((d / "huge.jsonl").string());
    FAIL();
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("huge.jsonl:2: not valid JSON"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}
