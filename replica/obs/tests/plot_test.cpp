#include "replica/obs/plot.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

namespace fs = std::filesystem;
using namespace replica::obs;

namespace {

fs::path project_with_metrics(const std::string& name, const std::string& lines) {
  const fs::path dir = fs::temp_directory_path() / ("replica-plot-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "metrics.jsonl") << lines;
  return dir;
}

std::string metrics_lines() {
  std::string s;
  for (int step = 10; step <= 100; step += 10) {
    s += "{\"step\":" + std::to_string(step) + ",\"epoch\":" + std::to_string(step / 50.0) +
         ",\"loss\":" + std::to_string(2.0 / step) + ",\"lr\":" + std::to_string(1e-3 * (1 - step / 100.0)) +
         ",\"samples_per_s\":" + std::to_string(1000 + step) + "}\n";
    if (step % 50 == 0) {
      s += "{\"step\":" + std::to_string(step) + ",\"epoch\":1,\"eval_loss\":0.5,\"eval_accuracy\":0.8}\n";
    }
  }
  return s;
}

}  // namespace

TEST(Plot, GnuplotRendersAPngAndAnSvg) {
  ASSERT_FALSE(find_gnuplot().empty()) << "gnuplot is part of the setup (scripts/setup.sh: gnuplot-nox)";
  const fs::path dir = project_with_metrics("ok", metrics_lines());
  const PlotResult png = plot_metrics(dir.string(), "png");
  ASSERT_TRUE(png.written) << png.note;
  EXPECT_EQ(png.path, (dir / "metrics.png").string());
  std::ifstream in(png.path, std::ios::binary);
  char magic[8] = {};
  in.read(magic, 8);
  EXPECT_EQ(std::string(magic, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_GT(fs::file_size(png.path), 10000u);  // four panels of curves, not an empty canvas

  const PlotResult svg = plot_metrics(dir.string(), "svg");
  ASSERT_TRUE(svg.written) << svg.note;
  std::ifstream s(svg.path);
  const std::string text((std::istreambuf_iterator<char>(s)), std::istreambuf_iterator<char>());
  // Axes labels and the panel titles are there.
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("learning rate"), std::string::npos);
  EXPECT_NE(text.find("throughput"), std::string::npos);
  EXPECT_NE(text.find(">step<"), std::string::npos);
  EXPECT_NE(text.find("eval_accuracy"), std::string::npos);
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << "left behind: " << e.path();
  }
  fs::remove_all(dir);
}

TEST(Plot, MissingGnuplotIsAOneLineNoteNotAFailure) {
  const fs::path dir = project_with_metrics("nognuplot", metrics_lines());
  setenv("REPLICA_GNUPLOT", "/nonexistent/gnuplot", 1);
  const PlotResult r = plot_metrics(dir.string());
  unsetenv("REPLICA_GNUPLOT");
  EXPECT_FALSE(r.written);
  EXPECT_NE(r.note.find("gnuplot not found"), std::string::npos) << r.note;
  EXPECT_EQ(r.note.find('\n'), std::string::npos);
  EXPECT_FALSE(fs::exists(dir / "metrics.png"));
  fs::remove_all(dir);
}

TEST(Plot, BadInputsAreErrorsNamingTheFile) {
  auto message = [](const std::string& dir) {
    try {
      plot_metrics(dir);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("/nonexistent/project").find("/nonexistent/project/metrics.jsonl"), std::string::npos);
  const fs::path bad = project_with_metrics("bad", "{\"step\":1,\"loss\":1}\nnot json\n");
  EXPECT_NE(message(bad.string()).find("metrics.jsonl:2"), std::string::npos) << message(bad.string());
  fs::remove_all(bad);
}

// Every legend lies below its panel's curves (SVG y grows downwards): no legend covers a
// point, such as the last evaluation of a rising accuracy or the end of a falling loss.
TEST(Plot, LegendsCoverNoPointOfTheCurves) {
  ASSERT_FALSE(find_gnuplot().empty()) << "gnuplot is part of the setup (scripts/setup.sh: gnuplot-nox)";
  std::string lines = metrics_lines();
  lines += "{\"step\":100,\"epoch\":2,\"eval_loss\":0.4,\"eval_accuracy\":0.95}\n";  // the last point, rising
  const fs::path dir = project_with_metrics("legend", lines);
  const PlotResult svg = plot_metrics(dir.string(), "svg");
  ASSERT_TRUE(svg.written) << svg.note;
  std::ifstream in(svg.path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::regex translate(R"(translate\(([0-9.]+),([0-9.]+)\))");
  const std::regex point(R"([ML]([0-9.]+),([0-9.]+))");
  int checked = 0;
  for (const std::string key : {"loss", "eval_loss", "lr", "samples_per_s", "eval_accuracy"}) {
    SCOPED_TRACE(key);
    // gnuplot writes each curve as <g id="gnuplot_plot_N..."><title>KEY</title>, then its
    // legend text at translate(x,y), then one path d='...' holding the legend's sample line
    // (at that height) and the curve.
    const size_t at = text.find("<title>" + key + "</title>");
    ASSERT_NE(at, std::string::npos);
    const std::string rest = text.substr(at);
    std::smatch m;
    ASSERT_TRUE(std::regex_search(rest, m, translate));
    const double legend_y = std::stod(m[2].str());
    const size_t d = rest.find("d='");
    ASSERT_NE(d, std::string::npos);
    const std::string curve = rest.substr(d + 3, rest.find('\'', d + 3) - (d + 3));
    int points = 0;
    for (auto it = std::sregex_iterator(curve.begin(), curve.end(), point); it != std::sregex_iterator(); ++it) {
      const double y = std::stod((*it)[2].str());
      if (std::abs(y - legend_y) < 8) continue;  // the legend's own sample line
      EXPECT_LT(y, legend_y - 8) << "a point of " << key << " at y " << y << " is at or below its legend (y "
                                 << legend_y << ")";
      ++points;
    }
    EXPECT_GT(points, 1);
    ++checked;
  }
  EXPECT_EQ(checked, 5);
  fs::remove_all(dir);
}

