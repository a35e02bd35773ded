#include "replica/distributed/shm_transport.h"

#include "replica/core/error.h"

#include <torch/torch.h>

namespace replica::distributed {

struct ShmTransport::Task final : Work::Impl {
  torch::Tensor tensor;
  Op op = Op::kAllreduce;
  float divisor = 1.0f;
  std::mutex mutex;
  std::condition_variable cv;
  bool finished = false;
  std::exception_ptr error;

  void wait() override {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return finished; });
    if (error) std::rethrow_exception(error);
  }
  bool done() const override {
    std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(mutex));
    return finished;
  }
};

ShmTransport::ShmTransport(std::unique_ptr<ShmAllreduce> local, std::shared_ptr<ProcessGroup> leaders,
                           bool multi_node)
    : local_(std::move(local)), leaders_(std::move(leaders)), multi_node_(multi_node) {
  thread_ = std::thread([this] { loop(); });
}

ShmTransport::~ShmTransport() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool ShmTransport::supports(const torch::Tensor& t) {
  const auto dt = t.scalar_type();
  return t.device().is_cpu() && t.is_contiguous() &&
         (dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kHalf || dt == torch::kDouble);
}

Work ShmTransport::submit(torch::Tensor tensor, Op op, float divisor) {
  if (op != Op::kAllreduce && multi_node_) {
    fail("shm transport: reduce-scatter, all-gather and barrier are single-node only");
  }
  auto task = std::make_shared<Task>();
  task->tensor = std::move(tensor);
  task->op = op;
  task->divisor = divisor;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(task);
  }
  cv_.notify_one();
  return Work(task);
}

torch::Tensor ShmTransport::alloc(int64_t numel, torch::ScalarType dtype) {
  // ShmAllreduce is used by one thread at a time: let the queue drain first.
  std::unique_lock<std::mutex> lock(mutex_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  return local_->alloc(numel, dtype);
}

torch::Tensor ShmTransport::alloc_shared(int64_t numel, torch::ScalarType dtype) {
  if (multi_node_) fail("shm transport: alloc_shared is single-node only");
  std::unique_lock<std::mutex> lock(mutex_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  return local_->alloc_shared(numel, dtype);
}

void ShmTransport::run(torch::Tensor& tensor, Op op, float divisor) {
  if (op == Op::kBarrier) return local_->barrier();
  if (op == Op::kReduceScatter) return local_->reduce_scatter_sum(tensor, divisor);
  if (op == Op::kAllGather) return local_->all_gather(tensor);
  local_->allreduce_sum(tensor);
  if (!multi_node_) return;
  if (leaders_) {
    leaders_->allreduce_sum(tensor).wait();
  } else {
    tensor.zero_();
  }
  local_->allreduce_sum(tensor);
}

void ShmTransport::loop() {
  for (;;) {
    std::shared_ptr<Task> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping with nothing left
      task = queue_.front();
      queue_.pop_front();
      busy_ = true;
    }
    try {
      run(task->tensor, task->op, task->divisor);
    } catch (...) {
      task->error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(task->mutex);
      task->finished = true;
    }
    task->cv.notify_all();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
    }
    idle_cv_.notify_all();
  }
}

}  // namespace replica::distributed
