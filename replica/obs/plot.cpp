#include "replica/obs/plot.h"

#include "replica/core/error.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace fs = std::filesystem;

namespace replica::obs {
namespace {

// Points of one curve: "step value" lines of a gnuplot data block.
using Series = std::map<std::string, std::vector<std::pair<double, double>>>;

// A gnuplot data block's name: letters, digits and _ only (metrics such as rewards/chosen
// carry a '/').
std::string block_name(const std::string& key) {
  std::string out = key;
  for (char& c : out) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return out;
}

std::string data_block(const std::string& name, const std::vector<std::pair<double, double>>& points) {
  std::string out = "$" + block_name(name) + " << EOD\n";
  for (const auto& [x, y] : points) out += fmt::format("{} {:.9g}\n", x, y);
  return out + "EOD\n";
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '_') out += "\\\\";  // gnuplot's enhanced text reads _ as a subscript
    out += c;
  }
  return out + "\"";
}

// A gnuplot single-quoted string: no escapes; a quote is doubled.
std::string path_literal(const std::string& path) {
  std::string out = "'";
  for (char c : path) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

// One panel: the given series on one plot, or a note when none has points. The legend sits
// below the plot area, in a row, where it can cover no point of any curve (inside, a corner
// covered the last evaluation of rising curves).
std::string panel(const Series& s, const std::string& title, const std::string& ylabel,
                  const std::vector<std::string>& keys) {
  std::string out = fmt::format("set title {}\nset xlabel \"step\"\nset ylabel {}\nset key below horizontal\n",
                                quoted(title), quoted(ylabel));
  std::vector<std::string> plots;
  int color = 1;
  for (const auto& key : keys) {
    auto it = s.find(key);
    if (it == s.end() || it->second.empty()) continue;
    // tokens_per_s of a task without tokens is 0 throughout: not a curve worth a legend.
    if (std::all_of(it->second.begin(), it->second.end(), [](const auto& p) { return p.second == 0; })) continue;
    const char* style = it->second.size() < 30 ? "linespoints pt 7 ps 0.6" : "lines";
    plots.push_back(fmt::format("${} using 1:2 with {} lw 2 lc {} title {}", block_name(key), style, color++, quoted(key)));
  }
  if (plots.empty()) {
    return out + fmt::format("set label 1 {} at graph 0.5, graph 0.5 center\nset xrange [0:1]\nset yrange [0:1]\n"
                             "plot -1 notitle\nunset label 1\nset autoscale xy\n",
                             quoted("no " + ylabel + " in this run"));
  }
  out += "plot ";
  for (size_t i = 0; i < plots.size(); ++i) out += (i ? ", " : "") + plots[i];
  return out + "\n";
}

// Runs `gnuplot script` with its stderr in a file; the message when it fails.
std::string run_gnuplot(const std::string& gnuplot, const std::string& script, const std::string& errors) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, errors.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  std::vector<std::string> args_s = {gnuplot, script};
  std::vector<char*> argv;
  for (auto& a : args_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, gnuplot.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return fmt::format("cannot start {}: {}", gnuplot, std::strerror(rc));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return {};
  std::ifstream in(errors);
  std::stringstream text;
  text << in.rdbuf();
  return fmt::format("{} failed: {}", gnuplot, text.str());
}

}  // namespace

std::string find_gnuplot() {
  if (const char* forced = std::getenv("REPLICA_GNUPLOT")) {
    return access(forced, X_OK) == 0 ? std::string(forced) : std::string();
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (fs::path(dir.empty() ? "." : dir) / "gnuplot").string();
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return {};
}

PlotResult plot_metrics(const std::string& project_dir, const std::string& format) {
  if (format != "png" && format != "svg") fail("plot format '{}' is not one of png, svg", format);
  const fs::path metrics = fs::path(project_dir) / "metrics.jsonl";
  std::ifstream in(metrics);
  if (!in) fail("'{}' cannot be read: is '{}' a replica project directory?", metrics.string(), project_dir);
  Series s;
  std::set<std::string> eval_keys;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      fail("{}:{}: not a JSON object: {}", metrics.string(), line_no, e.what());
    }
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number()) {
      fail("{}:{}: a metrics record needs a numeric \"step\"", metrics.string(), line_no);
    }
    const double step = j["step"].get<double>();
    for (const auto& [key, value] : j.items()) {
      if (key == "step" || key == "epoch" || !value.is_number()) continue;
      const double v = value.get<double>();
      if (!std::isfinite(v)) continue;
      s[key].emplace_back(step, v);
      if (key.rfind("eval_", 0) == 0 && key != "eval_loss" && key != "eval_samples" && key != "eval_tokens") {
        eval_keys.insert(key);
      }
    }
  }
  if (line_no == 0) fail("'{}' is empty: nothing to plot", metrics.string());

  const std::string gnuplot = find_gnuplot();
  const fs::path image = fs::path(project_dir) / ("metrics." + format);
  if (gnuplot.empty()) {
    return {false, {}, "gnuplot not found (apt-get install gnuplot-nox): no plot of " + metrics.string()};
  }

  const std::string tmp_image = image.string() + ".tmp." + std::to_string(getpid());
  std::string script;
  script += format == "png" ? "set terminal pngcairo size 1400,1000 font \"sans,11\"\n"
                            : "set terminal svg size 1400,1000 dynamic font \"sans,11\"\n";
  script += "set output " + path_literal(tmp_image) + "\nset grid\n";
  std::string safe_keys;
  for (const auto& [key, points] : s) {
    std::string name = key;
    for (char& c : name) if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
    if (name != key) continue;  // a name gnuplot cannot take as a data block: not plotted
    script += data_block(key, points);
  }
  script += fmt::format("set multiplot layout 2,2 title {}\n", quoted("replica: " + fs::path(project_dir).filename().string()));
  script += panel(s, "loss", "loss", {"loss", "eval_loss"});
  script += panel(s, "learning rate", "learning rate", {"lr"});
  script += panel(s, "throughput", "per second", {"samples_per_s", "tokens_per_s"});
  script += panel(s, "evaluation", "eval metric", std::vector<std::string>(eval_keys.begin(), eval_keys.end()));
  script += "unset multiplot\nset output\n";

  char script_path[] = "/tmp/replica-plot-XXXXXX";
  const int fd = mkstemp(script_path);
  if (fd < 0) fail("cannot create a temporary gnuplot script: {}", std::strerror(errno));
  close(fd);
  {
    std::ofstream out(script_path);
    out << script;
  }
  const std::string errors = std::string(script_path) + ".err";
  const std::string failure = run_gnuplot(gnuplot, script_path, errors);
  fs::remove(script_path);
  fs::remove(errors);
  if (!failure.empty()) {
    std::error_code ec;
    fs::remove(tmp_image, ec);
    fail("plotting {}: {}", metrics.string(), failure);
  }
  fs::rename(tmp_image, image);
  return {true, image.string(), {}};
}

}  // namespace replica::obs
