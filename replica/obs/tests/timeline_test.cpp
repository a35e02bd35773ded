#include "replica/obs/timeline.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <thread>

using namespace replica::obs;

TEST(Timeline, DisabledRecordsNothing) {
  Timeline::instance().disable();
  { Span s("forward", "compute"); }
  EXPECT_EQ(Timeline::instance().size(), 0u);
}

TEST(Timeline, MergedTraceIsChromeTraceJsonWithOneProcessPerRank) {
  auto& t = Timeline::instance();
  std::vector<std::string> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    t.enable(rank);
    {
      Span forward("forward", "compute");
    }
    // From another thread, as DDP's transport does.
    std::thread([&] { t.record("allreduce bucket 0", "comm", "comm", 100, 250, R"({"bytes":4096})"); }).join();
    ranks.push_back(t.take_chrome_trace_events());
    EXPECT_EQ(t.size(), 0u);
  }
  t.disable();
  const auto trace = nlohmann::json::parse(merge_chrome_trace(ranks));
  ASSERT_TRUE(trace["traceEvents"].is_array());
  int spans = 0;
  std::map<int, std::set<std::string>> names;
  std::map<std::pair<int, int>, std::string> thread_names;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      thread_names[{e["pid"].get<int>(), e["tid"].get<int>()}] = e["args"]["name"];
    }
    if (e["ph"] != "X") continue;
    ++spans;
    const std::string track = thread_names[std::make_pair(e["pid"].get<int>(), e["tid"].get<int>())];
    names[e["pid"].get<int>()].insert(e["name"].get<std::string>());
    EXPECT_GE(e["dur"].get<int64_t>(), 0);
    if (e["name"] == "allreduce bucket 0") {
      EXPECT_EQ(e["ts"], 100);
      EXPECT_EQ(e["dur"], 150);
      EXPECT_EQ(e["args"]["bytes"], 4096);
      EXPECT_EQ(track, "comm");
    } else {
      EXPECT_EQ(track, "compute");
    }
  }
  EXPECT_EQ(spans, 4);
  const std::set<std::string> both = {"forward", "allreduce bucket 0"};
  EXPECT_EQ(names[0], both);
  EXPECT_EQ(names[1], both);
}
