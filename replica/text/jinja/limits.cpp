// Jinja interpreter: the bounds every template is held to (Note [bounded templates] in
// jinja.h): the recursion guard, the render budget, and the iterative release of values.
#include "replica/text/jinja/jinja.h"

namespace replica::text::detail::jinja {

namespace {

// Plain thread_locals (no destructors): they stay valid while any thread, or static
// destruction, still destroys values.
thread_local int t_recursion = 0;
thread_local RenderBudget* t_budget = nullptr;
thread_local std::vector<std::shared_ptr<void>>* t_pending_release = nullptr;

std::string mib(uint64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

}  // namespace

RecursionGuard::RecursionGuard() {
  if (++t_recursion > kMaxRecursion) {
    --t_recursion;
    raise_error(EKind::Runtime, "maximum recursion depth exceeded (the template nests evaluation, "
                                "macro calls or values more than " +
                                    std::to_string(kMaxRecursion) + " levels deep)");
  }
}

RecursionGuard::~RecursionGuard() { --t_recursion; }

RenderBudget::RenderBudget(uint64_t input_values, uint64_t input_bytes)
    : steps_limit_(kBaseSteps + kStepsPerInputValue * input_values),
      steps_left_(steps_limit_),
      bytes_limit_(kBaseBytes + kBytesPerInputByte * input_bytes),
      bytes_left_(bytes_limit_),
      outer_(t_budget) {
  t_budget = this;
}

RenderBudget::~RenderBudget() { t_budget = outer_; }

void charge_steps(uint64_t n) {
  RenderBudget* b = t_budget;
  if (!b) return;
  if (n > b->steps_left_) {
    raise_error(EKind::Runtime, "the template exceeded its budget of " + std::to_string(b->steps_limit_) +
                                    " steps (expressions, statements and loop iterations): a loop or "
                                    "recursion too large for a chat template");
  }
  b->steps_left_ -= n;
}

void charge_bytes(uint64_t n) {
  RenderBudget* b = t_budget;
  if (!b) return;
  if (n > b->bytes_left_) {
    raise_error(EKind::Runtime, "the template exceeded its budget of " + mib(b->bytes_limit_) +
                                    " of strings, lists and output: a string or list too large for "
                                    "a chat template");
  }
  b->bytes_left_ -= n;
}

void charge_bytes(uint64_t count, uint64_t each) {
  if (each != 0 && count > UINT64_MAX / each) {
    charge_bytes(UINT64_MAX);
    return;
  }
  charge_bytes(count * each);
}

void charge_items(uint64_t times, const std::vector<Value>& items) {
  if (times == 0 || items.empty()) return;
  uint64_t bytes = 0;
  for (const auto& v : items) bytes += sizeof(Value) + v.s.size();
  const uint64_t n = items.size();
  charge_steps(times > UINT64_MAX / n ? UINT64_MAX : times * n);
  charge_bytes(times, bytes);
}

// Frees the containers `v` held the last reference to without recursing: their contents'
// destructors, run from the loop below, only add to the pending list (values nested a
// million deep would otherwise be freed a million frames deep). Every strong reference to a
// container is a Value (generators and loop methods hold their sources as Values), so a
// reference that is not the last one can be dropped as it is: the last holder comes here.
void Value::release_contents() noexcept {
  auto hand_over = [this](std::vector<std::shared_ptr<void>>& pending) {
    if (list && list.use_count() == 1) pending.push_back(std::move(list));
    if (dict && dict.use_count() == 1) pending.push_back(std::move(dict));
    if (fn && fn.use_count() == 1) pending.push_back(std::move(fn));
    if (loop && loop.use_count() == 1) pending.push_back(std::move(loop));
    if (iter && iter.use_count() == 1) pending.push_back(std::move(iter));
  };
  if (t_pending_release) {
    hand_over(*t_pending_release);
    return;
  }
  std::vector<std::shared_ptr<void>> pending;
  hand_over(pending);
  if (pending.empty()) return;
  t_pending_release = &pending;
  while (!pending.empty()) {
    std::shared_ptr<void> p = std::move(pending.back());
    pending.pop_back();
    p.reset();  // may add to `pending`
  }
  t_pending_release = nullptr;
}

}  // namespace replica::text::detail::jinja
