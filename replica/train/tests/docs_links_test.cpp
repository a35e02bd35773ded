// Issue 36: README.md is a short front page and docs/ the guide, cross-linked page to page and
// section to section. A page renamed, a heading reworded or a file moved would leave links
// that lead nowhere, which no reader reports until they are lost. Every relative link of
// README.md and docs/*.md must reach a file of the checkout, and every #anchor a heading of
// the page it names, as GitHub spells heading anchors.
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

using replica::testing::read_file;

const fs::path kSource = REPLICA_SOURCE_DIR;

bool is_fence(const std::string& line) {
  const auto first = line.find_first_not_of(' ');
  return first != std::string::npos && line.compare(first, 3, "```") == 0;
}

// GitHub's anchor of a heading: lower case; letters, digits, '-', '_' and spaces kept (bytes of
// UTF-8 characters too), every other character dropped; each space a '-'.
std::string anchor_of(const std::string& heading) {
  std::string out;
  for (const unsigned char c : heading) {
    if (std::isalnum(c) || c == '-' || c == '_' || c >= 0x80) {
      out += static_cast<char>(std::tolower(c));
    } else if (c == ' ') {
      out += '-';
    }
  }
  return out;
}

// The anchors a page's headings make (outside code blocks); a repeated one gets -1, -2, ...
std::set<std::string> anchors_of(const std::string& markdown) {
  std::set<std::string> anchors;
  std::map<std::string, int> seen;
  std::istringstream in(markdown);
  bool code = false;
  for (std::string line; std::getline(in, line);) {
    if (is_fence(line)) code = !code;
    if (code || line.empty() || line[0] != '#') continue;
    const auto text = line.find_first_not_of('#');
    if (text == std::string::npos || line[text] != ' ') continue;
    const std::string base = anchor_of(line.substr(text + 1));
    const int n = seen[base]++;
    anchors.insert(n == 0 ? base : base + "-" + std::to_string(n));
  }
  return anchors;
}

struct Link {
  int line;
  std::string target;
};

// Every [text](target) outside code blocks and code spans.
std::vector<Link> links_of(const std::string& markdown) {
  static const std::regex span("`[^`]*`");
  static const std::regex link(R"(\[[^\]]*\]\(([^)\s]+)\))");
  std::vector<Link> links;
  std::istringstream in(markdown);
  bool code = false;
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    if (is_fence(line)) {
      code = !code;
      continue;
    }
    if (code) continue;
    const std::string prose = std::regex_replace(line, span, "``");
    for (auto it = std::sregex_iterator(prose.begin(), prose.end(), link); it != std::sregex_iterator(); ++it) {
      links.push_back({n, (*it)[1].str()});
    }
  }
  return links;
}

std::vector<fs::path> pages() {
  std::vector<fs::path> out = {kSource / "README.md"};
  for (const auto& e : fs::directory_iterator(kSource / "docs")) {
    if (e.path().extension() == ".md") out.push_back(e.path());
  }
  return out;
}

// What is wrong with `target` as a link of `page`, or "".
std::string broken(const fs::path& page, const std::string& target) {
  const auto hash = target.find('#');
  const std::string file = target.substr(0, hash);
  const std::string anchor = hash == std::string::npos ? "" : target.substr(hash + 1);
  const fs::path resolved = file.empty() ? page : fs::weakly_canonical(page.parent_path() / file);
  const std::string root = fs::weakly_canonical(kSource).string() + "/";
  if (!file.empty() && (resolved.string() + "/").rfind(root, 0) != 0) return "leads outside the repository";
  if (!fs::exists(resolved)) return "no such file or directory: " + resolved.string();
  if (anchor.empty()) return "";
  if (resolved.extension() != ".md") return "#" + anchor + " on a file that is not a Markdown page";
  const auto anchors = anchors_of(read_file(resolved));
  if (anchors.count(anchor) == 0) return "no heading of " + resolved.filename().string() + " makes #" + anchor;
  return "";
}

TEST(DocsLinks, EveryRelativeLinkOfReadmeAndDocsReachesAFileAndHeading) {
  int checked = 0;
  for (const auto& page : pages()) {
    for (const auto& link : links_of(read_file(page))) {
      if (std::regex_search(link.target, std::regex("^[a-z]+:"))) continue;  // https:, mailto:
      const std::string why = broken(page, link.target);
      EXPECT_EQ(why, "") << fs::relative(page, kSource).string() << ":" << link.line << ": (" << link.target << ") "
                         << why;
      ++checked;
    }
  }
  EXPECT_GT(checked, 100) << "the pages' links were not found";
}

// The anchor rules above, on the headings the pages use.
TEST(DocsLinks, AnchorsAreGitHubs) {
  EXPECT_EQ(anchor_of("Building: LibTorch 2.x from PyTorch's wheel, or from an archive"),
            "building-libtorch-2x-from-pytorchs-wheel-or-from-an-archive");
  EXPECT_EQ(anchor_of("`replica keys TASK`"), "replica-keys-task");
  EXPECT_EQ(anchor_of("Sharded optimizer step (`params.shard_optimizer`, on by default on one host)"),
            "sharded-optimizer-step-paramsshard_optimizer-on-by-default-on-one-host");
  EXPECT_EQ(anchor_of("Measured: LoRA SFT memory against transformers + peft"),
            "measured-lora-sft-memory-against-transformers--peft");
  EXPECT_EQ(anchors_of("# A\n```\n# not a heading\n```\n## A\n"), (std::set<std::string>{"a", "a-1"}));
  const auto links = links_of("see [x](a.md#b) and `[y](c.md)`\n```\n[z](d.md)\n```\n");
  ASSERT_EQ(links.size(), 1u);
  EXPECT_EQ(links[0].target, "a.md#b");
}

}  // namespace
