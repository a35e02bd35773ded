#include "replica/train/nonfinite.h"

#include "replica/core/error.h"
#include "replica/distributed/process_group.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>

namespace replica::train {
namespace {

// At most this many ranks are named in a message; the rest are counted.
constexpr size_t kRanksNamed = 3;

// Collective: the number of ranks where `bad`, then (only when some) every rank's `detail`,
// joined as "rank R: DETAIL; ..." over the ranks where it is not empty. Every rank returns
// the same text.
std::string agree(bool bad, const std::string& detail, distributed::ProcessGroup& pg) {
  auto count = torch::tensor({bad ? 1.0 : 0.0}, torch::kDouble);
  pg.allreduce_sum(count).wait();
  if (count.item<double>() == 0) return "";
  const std::vector<std::string> details = pg.allgather_strings(bad ? detail : std::string());
  std::string out;
  size_t named = 0, more = 0;
  for (size_t rank = 0; rank < details.size(); ++rank) {
    if (details[rank].empty()) continue;
    if (named == kRanksNamed) {
      ++more;
      continue;
    }
    out += fmt::format("{}rank {}: {}", named == 0 ? "" : "; ", rank, details[rank]);
    ++named;
  }
  if (more > 0) out += fmt::format("; and {} more rank{}", more, more == 1 ? "" : "s");
  return out;
}

}  // namespace

void StepLosses::add(double loss) {
  if (first_bad_ < 0 && !std::isfinite(loss)) {
    first_bad_ = count_;
    bad_value_ = loss;
  }
  ++count_;
}

std::string StepLosses::describe() const {
  if (finite()) return "";
  // "nan" whatever its sign bit (which means nothing), "inf" or "-inf".
  const std::string value = std::isnan(bad_value_) ? "nan" : bad_value_ > 0 ? "inf" : "-inf";
  return fmt::format("{} in micro-batch {} of {}", value, first_bad_ + 1, count_);
}

NonfiniteLosses agree_on_losses(const StepLosses& mine, distributed::ProcessGroup& pg) {
  NonfiniteLosses out;
  out.where = agree(!mine.finite(), mine.describe(), pg);
  out.found = !out.where.empty();
  return out;
}

std::string nonfinite_stop_message(int64_t step, const std::string& what, bool read_late) {
  return fmt::format("step {}: {}; the run stops {} and nothing non-finite was saved (lower lr, check the data, or "
                     "set nonfinite_loss: skip (--nonfinite-loss skip) to skip such steps)",
                     step, what, read_late ? "(this step's update is not saved)" : "before this step's update");
}

void require_finite_weights(const std::vector<torch::Tensor>& params, const std::vector<std::string>& names,
                            distributed::ProcessGroup& pg, int64_t step, const std::string& saving) {
  // One flag per tensor, brought to the host at once (one device sync on a GPU).
  std::vector<torch::Tensor> flags;
  std::vector<size_t> which;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined() || params[i].numel() == 0) continue;
    flags.push_back(torch::isfinite(params[i].detach()).all());
    which.push_back(i);
  }
  std::string detail;
  if (!flags.empty()) {
    const torch::Tensor finite = torch::stack(flags).cpu();
    const bool* ok = finite.data_ptr<bool>();
    size_t bad = 0;
    for (size_t k = 0; k < which.size(); ++k) {
      if (ok[k]) continue;
      if (bad++ == 0) detail = fmt::format("'{}'", which[k] < names.size() ? names[which[k]] : "?");
    }
    if (bad > 1) detail += fmt::format(" and {} more tensor{}", bad - 1, bad == 2 ? "" : "s");
  }
  const std::string where = agree(!detail.empty(), detail, pg);
  if (where.empty()) return;
  fail("step {}: the trained weights hold NaN or Inf after the optimizer step ({}); {} is not written and the run "
       "stops (lower lr or max_grad_norm, or check the data)",
       step, where, saving);
}

}  // namespace replica::train
