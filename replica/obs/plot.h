// `replica plot PROJECT_DIR`: training curves from metrics.jsonl, rendered by gnuplot.
//
// What: plot_metrics() reads project/metrics.jsonl and writes project/metrics.png (or .svg):
// four panels with axes, labels and legends: loss (train, and eval_loss when evaluated),
// learning rate, throughput (samples/s, tokens/s when counted) and the eval metrics
// (eval_accuracy and any other eval_* besides loss/samples/tokens) against the step.
// The trainer calls it at the end of every run (rank 0).
//
// Why gnuplot: a real plotting tool (Debian's gnuplot-nox) draws the axes, ticks and
// legends; replica only writes its data blocks and a short script. When gnuplot is not
// installed no plot is made and `note` says so in one line (training is not failed for it).
//
// Thread-safety: independent calls are safe (temporary files are unique); it forks gnuplot.
#pragma once

#include <string>

namespace replica::obs {

struct PlotResult {
  bool written = false;
  std::string path;  // the image, when written
  std::string note;  // why not, when not written
};

// format: "png" or "svg". replica::Error naming the file (and line) when the project has no
// readable metrics.jsonl, a line is not JSON, or gnuplot fails.
PlotResult plot_metrics(const std::string& project_dir, const std::string& format = "png");

// The gnuplot program on PATH (REPLICA_GNUPLOT overrides it), or empty when there is none.
std::string find_gnuplot();

}  // namespace replica::obs
