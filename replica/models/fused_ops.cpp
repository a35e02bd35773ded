// See fused_ops.h. The CUDA kernels are compiled in with REPLICA_FUSED_KERNELS where LibTorch has
// CUDA and the CUDA compiler built replica/models/cuda/fused_kernels.cu (CMakeLists.txt); the CPU
// kernels (replica/models/cpu/fused_kernels.cpp) are in every x86-64 build and run where the CPU
// has AVX2 and FMA.
//
// Note [fused kernels]
// A Llama step is not only GEMMs. On a GPU the Kineto trace of the 503M bf16 step on an H100
// (bench/gpu_reports/h100-2026-11-26.md) spent 29.6 ms of 115 in cuBLAS and ~70 ms in ATen's
// elementwise kernels, the same kernels PyTorch eager runs. Per layer, HF's RMSNorm is six
// kernels each way (pow, mean, add, rsqrt, mul, mul), its rotary embedding five per tensor
// (two muls, neg, cat, add) over a transposed view, SwiGLU two, each writing a tensor autograd
// keeps. Four fused paths replace them, each one kernel forward and one backward:
//   RMSNorm  on CUDA ATen's own at::_fused_rms_norm (with its backward); on the CPU, where
//            ATen's is the composite, cpu/fused_kernels.cpp: fp32 statistics, one rounding to
//            the output dtype (HF rounds the normalised value, then multiplies by the weight: in
//            bf16 the two differ by at most one bf16 ulp; in fp32 by float rounding). Taken when
//            x and the weight share a dtype and the family multiplies by the weight (Llama's and
//            Olmo's styles; Gemma's 1 + w keeps the composite).
//   rotary   x [B, T, H, D] contiguous, read once, rotated in fp32, written in the dtype
//            attention consumes; under autocast that is the autocast dtype (what SDPA would cast
//            HF's fp32 result to, so the values are the same), else the promotion of x's and
//            cos's dtypes, as HF's x * cos. The backward applies the transposed rotation;
//            cos/sin need no gradient.
//   SwiGLU   silu(g) * u in fp32, rounded once; backward from g and u only (HF keeps g, silu(g)
//            and u).
//   loss     cross-entropy straight from the head's logits: on a GPU one block per token, an
//            online logsumexp in fp32 forward, softmax - one_hot written in the logits' dtype
//            backward; on the CPU the same per row. The composite casts bf16 logits to fp32 (a
//            copy twice their size), keeps fp32 log-probabilities, and its backward zero-fills
//            a [tokens, vocabulary] gradient, scatters into it and reads it again.
// Measured on the H100 (bench/gpu_reports/h100-2026-11-26-fused.md, 503M Llama, 8 x 1024
// tokens): 70,017 -> 107,139 tokens/s under bf16 autocast, 79,871 -> 126,906 with bf16 weights.
// On the CPU the kernels take fp32 tensors only (bf16 on a CPU keeps the composite). There
// (bench/llama_step, 18.7M Llama, 4 x 256 tokens, one thread) they cut the step's non-GEMM self
// time from ~540 to ~300 ms: 461 -> 485 tokens/s (bench/README.md, tenth sitting).
// Any tensor of an unsupported dtype, device or layout keeps the composite. The tests
// (fused_gpu_test.cpp, fused_cpu_test.cpp) hold each fused op to the composite within float
// rounding, forward and backward.
#include "replica/models/fused_ops.h"

#include "replica/core/error.h"
#include "replica/models/cpu/fused_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#ifdef REPLICA_FUSED_KERNELS
#include "replica/models/cuda/fused_kernels.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace replica::models {

namespace {

std::atomic<bool>& fused_switch() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("REPLICA_FUSED_KERNELS");
    return !(v && std::strcmp(v, "0") == 0);
  }()};
  return on;
}

}  // namespace

bool fused_kernels_compiled() {
#ifdef REPLICA_FUSED_KERNELS
  return true;
#else
  return false;
#endif
}

bool fused_cpu_kernels_available() { return cpu_kernels::available(); }

bool set_fused_kernels(bool on) { return fused_switch().exchange(on); }

bool fused_kernels_for(const torch::Tensor& x) {
  if (!x.defined() || !fused_switch().load(std::memory_order_relaxed)) return false;
  if (x.is_cuda()) return fused_kernels_compiled();
  return x.is_cpu() && x.scalar_type() == torch::kFloat32 && x.layout() == torch::kStrided && cpu_kernels::available();
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- CPU: fp32 kernels over rows split across ATen's intra-op threads ---------------------

// Rows per task: about ATen's grain (32k elements) of work each.
int64_t grain_rows(int64_t row_size) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, row_size)); }

torch::Tensor fp32(const torch::Tensor& t) { return t.to(torch::kFloat32).contiguous(); }

void require_cpu_kernels(const char* what) {
  if (!cpu_kernels::available()) fail("{}: this CPU has no AVX2 + FMA for replica's fused CPU kernels", what);
}

torch::Tensor rotate_cpu(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::ScalarType out, bool backward) {
  require_cpu_kernels("rotary embedding");
  const auto x = fp32(x_in);
  auto y = torch::empty(x.sizes(), x.options());
  const int64_t T = x.size(1), H = x.size(2), D = x.size(3), rows = x.numel() / D;
  const int64_t cos_stride = cos.size(0) == 1 ? 0 : T * D;
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(D), [&](int64_t begin, int64_t end) {
    cpu_kernels::rotary(xp + begin * D, yp + begin * D, cp, sp, begin, end - begin, T, H, D / 2, cos_stride, backward);
  });
  return y.to(out);
}

variable_list swiglu_cpu(const torch::Tensor& g_in, const torch::Tensor& u_in, const torch::Tensor& dy_in) {
  require_cpu_kernels("SwiGLU");
  const auto g = fp32(g_in), u = fp32(u_in);
  const int64_t n = g.numel();
  const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
  const auto dtype = g_in.scalar_type();
  if (!dy_in.defined()) {
    auto out = torch::empty_like(g);
    float* op = out.data_ptr<float>();
    at::parallel_for(0, n, at::internal::GRAIN_SIZE,
                     [&](int64_t b, int64_t e) { cpu_kernels::swiglu_forward(gp + b, up + b, op + b, e - b); });
    return {out.to(dtype)};
  }
  const auto dy = fp32(dy_in);
  auto dg = torch::empty_like(g), du = torch::empty_like(u);
  const float* dyp = dy.data_ptr<float>();
  float *dgp = dg.data_ptr<float>(), *dup = du.data_ptr<float>();
  at::parallel_for(0, n, at::internal::GRAIN_SIZE, [&](int64_t b, int64_t e) {
    cpu_kernels::swiglu_backward(gp + b, up + b, dyp + b, dgp + b, dup + b, e - b);
  });
  return {dg.to(dtype), du.to(u_in.scalar_type())};
}

// Forward (grad undefined): fills loss and lse [N]. Backward: returns dlogits.
torch::Tensor cross_entropy_cpu(const torch::Tensor& logits_in, const torch::Tensor& targets, const torch::Tensor& lse,
                                const torch::Tensor& loss, const torch::Tensor& grad) {
  require_cpu_kernels("cross-entropy");
  const auto logits = fp32(logits_in);
  const int64_t N = logits.size(0), V = logits.size(1);
  const float* lp = logits.data_ptr<float>();
  const int64_t* tp = targets.data_ptr<int64_t>();
  float* lsep = lse.data_ptr<float>();
  if (!grad.defined()) {
    float* lossp = loss.data_ptr<float>();
    at::parallel_for(0, N, grain_rows(V), [&](int64_t b, int64_t e) {
      cpu_kernels::cross_entropy_forward(lp + b * V, tp + b, lossp + b, lsep + b, e - b, V);
    });
    return {};
  }
  const float g = grad.item<float>();
  auto dlogits = torch::empty_like(logits);
  float* dp = dlogits.data_ptr<float>();
  at::parallel_for(0, N, grain_rows(V), [&](int64_t b, int64_t e) {
    cpu_kernels::cross_entropy_backward(lp + b * V, tp + b, lsep + b, g, dp + b * V, e - b, V);
  });
  return dlogits.to(logits_in.scalar_type());
}

// RMSNorm on the CPU: x [..., H] and weight [H]; keeps x, the weight and the per-row rstd.
struct RmsNormCpuFunction : torch::autograd::Function<RmsNormCpuFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in, const torch::Tensor& weight, double eps) {
    require_cpu_kernels("RMSNorm");
    const auto x = fp32(x_in), w = fp32(weight);
    const int64_t H = w.numel(), rows = x.numel() / H;
    auto y = torch::empty_like(x);
    auto rstd = torch::empty({rows}, x.options());
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float *yp = y.data_ptr<float>(), *rp = rstd.data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(H), [&](int64_t b, int64_t e) {
      cpu_kernels::rms_norm_forward(xp + b * H, wp, yp + b * H, rp + b, e - b, H, static_cast<float>(eps));
    });
    ctx->save_for_backward({x, w, rstd});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x_in.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return y.to(x_in.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &rstd = saved[2];
    const auto dy = fp32(grads[0]);
    const int64_t H = w.numel(), rows = x.numel() / H;
    auto dx = torch::empty_like(x);
    const bool weight_grad = ctx->needs_input_grad(1);
    // One partial weight gradient per thread (ATen's thread index), summed after.
    auto dw_parts = weight_grad ? torch::zeros({at::get_num_threads(), H}, x.options()) : torch::Tensor();
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *rp = rstd.data_ptr<float>(),
                *dyp = dy.data_ptr<float>();
    float* dxp = dx.data_ptr<float>();
    float* partp = weight_grad ? dw_parts.data_ptr<float>() : nullptr;
    at::parallel_for(0, rows, grain_rows(H), [&](int64_t b, int64_t e) {
      float* part = partp ? partp + at::get_thread_num() * H : nullptr;
      cpu_kernels::rms_norm_backward(xp + b * H, wp, rp + b, dyp + b * H, dxp + b * H, part, e - b, H);
    });
    const auto x_dtype = static_cast<torch::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto w_dtype = static_cast<torch::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    return {dx.to(x_dtype), weight_grad ? dw_parts.sum(0).to(w_dtype) : torch::Tensor(), torch::Tensor()};
  }
};

// ---- CUDA: replica/models/cuda/fused_kernels.cu ------------------------------------------

#ifdef REPLICA_FUSED_KERNELS

namespace ck = cuda_kernels;

ck::Dtype kernel_dtype(torch::ScalarType t, const char* what) {
  switch (t) {
    case torch::kFloat32: return ck::Dtype::kFloat32;
    case torch::kBFloat16: return ck::Dtype::kBFloat16;
    case torch::kFloat16: return ck::Dtype::kFloat16;
    default: fail("{}: the fused CUDA kernel takes float32, bfloat16 or float16, not {}", what, c10::toString(t));
  }
}

void check(const char* error, const char* what) {
  if (error) fail("{}: CUDA kernel launch failed: {}", what, error);
}

void* current_stream(const torch::Tensor& on) { return c10::cuda::getCurrentCUDAStream(on.get_device()).stream(); }

// x [B, T, H, D] contiguous; cos/sin fp32 [Bc, T, D] contiguous.
torch::Tensor rotate_cuda(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::ScalarType out,
                          bool backward) {
  c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty(x.sizes(), x.options().dtype(out));
  ck::RotaryArgs a{};
  a.x = x.data_ptr();
  a.in_dtype = kernel_dtype(x.scalar_type(), "rotary embedding");
  a.out = y.data_ptr();
  a.out_dtype = kernel_dtype(out, "rotary embedding");
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.T = x.size(1);
  a.H = x.size(2);
  a.half = x.size(3) / 2;
  a.rows = x.size(0) * a.T * a.H;
  a.cos_batch_stride = cos.size(0) == 1 ? 0 : cos.size(1) * cos.size(2);
  a.backward = backward;
  a.stream = current_stream(x);
  check(ck::rotary(a), "rotary embedding");
  return y;
}


// One SwiGLU kernel: forward (dy undefined) gives {silu(g) * u}; backward gives {dg, du}.
variable_list swiglu_cuda(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& dy) {
  c10::cuda::CUDAGuard guard(g.device());
  const bool backward = dy.defined();
  ck::SwigluArgs a{};
  a.g = g.data_ptr();
  a.u = u.data_ptr();
  a.dtype = kernel_dtype(g.scalar_type(), "SwiGLU");
  a.n = g.numel();
  a.backward = backward;
  a.stream = current_stream(g);
  variable_list out;
  if (backward) {
    out = {torch::empty_like(g, torch::MemoryFormat::Contiguous), torch::empty_like(u, torch::MemoryFormat::Contiguous)};
    a.out_or_dy = dy.data_ptr();
    a.dg = out[0].data_ptr();
    a.du = out[1].data_ptr();
  } else {
    out = {torch::empty_like(g, torch::MemoryFormat::Contiguous)};
    a.out_or_dy = out[0].data_ptr();
  }
  check(ck::swiglu(a), backward ? "SwiGLU backward" : "SwiGLU");
  return out;
}


// One cross-entropy kernel over logits [N, V]: forward (grad undefined) fills loss [N] and lse
// [N]; backward reads lse and the sum's gradient and returns dlogits.
torch::Tensor cross_entropy_cuda(const torch::Tensor& logits, const torch::Tensor& targets, const torch::Tensor& lse,
                                   const torch::Tensor& loss, const torch::Tensor& grad) {
  c10::cuda::CUDAGuard guard(logits.device());
  const bool backward = grad.defined();
  ck::CrossEntropyArgs a{};
  a.logits = logits.data_ptr();
  a.dtype = kernel_dtype(logits.scalar_type(), "cross-entropy");
  a.targets = targets.data_ptr<int64_t>();
  a.lse = lse.data_ptr<float>();
  a.rows = logits.size(0);
  a.V = logits.size(1);
  a.backward = backward;
  a.stream = current_stream(logits);
  torch::Tensor dlogits;
  if (backward) {
    dlogits = torch::empty_like(logits, torch::MemoryFormat::Contiguous);
    a.grad = grad.data_ptr<float>();
    a.dlogits = dlogits.data_ptr();
  } else {
    a.loss = loss.data_ptr<float>();
  }
  check(ck::cross_entropy(a), backward ? "cross-entropy backward" : "cross-entropy");
  return dlogits;
}

#endif  // REPLICA_FUSED_KERNELS

// ---- One autograd function per op; the kernel by the tensors' device ----------------------

#ifndef REPLICA_FUSED_KERNELS
[[noreturn]] void no_cuda_kernels(const char* what) {
  fail("{}: this build has no CUDA kernels (LibTorch without CUDA, or no CUDA compiler)", what);
}
#endif

torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::ScalarType out,
                     bool backward) {
  if (!x.is_cuda()) return rotate_cpu(x, cos, sin, out, backward);
#ifdef REPLICA_FUSED_KERNELS
  return rotate_cuda(x, cos, sin, out, backward);
#else
  no_cuda_kernels("rotary embedding");
#endif
}

variable_list swiglu_kernel(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& dy) {
  if (!g.is_cuda()) return swiglu_cpu(g, u, dy);
#ifdef REPLICA_FUSED_KERNELS
  return swiglu_cuda(g, u, dy);
#else
  no_cuda_kernels("SwiGLU");
#endif
}

torch::Tensor cross_entropy_kernel(const torch::Tensor& logits, const torch::Tensor& targets, const torch::Tensor& lse,
                                   const torch::Tensor& loss, const torch::Tensor& grad) {
  if (!logits.is_cuda()) return cross_entropy_cpu(logits, targets, lse, loss, grad);
#ifdef REPLICA_FUSED_KERNELS
  return cross_entropy_cuda(logits, targets, lse, loss, grad);
#else
  no_cuda_kernels("cross-entropy");
#endif
}

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin, int64_t out) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    return rotate(x, cos, sin, static_cast<torch::ScalarType>(out), /*backward=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto x_dtype = static_cast<torch::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    auto dx = rotate(grads[0].contiguous(), saved[0], saved[1], x_dtype, /*backward=*/true);
    return {dx, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct SwigluFunction : torch::autograd::Function<SwigluFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& g, const torch::Tensor& u) {
    ctx->save_for_backward({g, u});
    return swiglu_kernel(g, u, torch::Tensor())[0];
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return swiglu_kernel(saved[0], saved[1], grads[0].to(saved[0].scalar_type()).contiguous());
  }
};

// Per-row loss and lse of contiguous logits [N, V] against int64 targets [N].
RowCrossEntropy cross_entropy_rows(const torch::Tensor& logits, const torch::Tensor& targets) {
  const auto fp32 = logits.options().dtype(torch::kFloat32);
  RowCrossEntropy rows{torch::empty({logits.size(0)}, fp32), torch::empty({logits.size(0)}, fp32)};
  cross_entropy_kernel(logits, targets, rows.lse, rows.loss, torch::Tensor());
  return rows;
}

struct CrossEntropySumFunction : torch::autograd::Function<CrossEntropySumFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets) {
    auto rows = cross_entropy_rows(logits, targets);
    ctx->save_for_backward({logits, targets, rows.lse});
    return rows.loss.sum();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto grad = grads[0].to(torch::kFloat32).contiguous();
    return {cross_entropy_kernel(saved[0], saved[1], saved[2], torch::Tensor(), grad), torch::Tensor()};
  }
};

void check_cross_entropy_shapes(const torch::Tensor& logits, const torch::Tensor& targets) {
  if (logits.dim() != 2 || targets.dim() != 1 || targets.size(0) != logits.size(0)) {
    fail("cross-entropy: logits {} and targets {} (want [N, V] and [N])", c10::str(logits.sizes()),
         c10::str(targets.sizes()));
  }
}

}  // namespace

torch::Tensor fused_cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets) {
  check_cross_entropy_shapes(logits, targets);
  return CrossEntropySumFunction::apply(logits.contiguous(), targets.to(torch::kInt64).contiguous());
}

RowCrossEntropy fused_cross_entropy_rows(const torch::Tensor& logits, const torch::Tensor& targets) {
  check_cross_entropy_shapes(logits, targets);
  return cross_entropy_rows(logits.contiguous(), targets.to(torch::kInt64).contiguous());
}

torch::Tensor fused_cross_entropy_rows_backward(const torch::Tensor& logits, const torch::Tensor& targets,
                                                const torch::Tensor& lse, const torch::Tensor& grad) {
  check_cross_entropy_shapes(logits, targets);
  return cross_entropy_kernel(logits.contiguous(), targets.to(torch::kInt64).contiguous(), lse.contiguous(),
                              torch::Tensor(), grad.to(torch::kFloat32).contiguous());
}

torch::Tensor fused_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                           torch::ScalarType out) {
  if (x.dim() != 4 || x.size(3) % 2 != 0 || cos.dim() != 3 || cos.sizes() != sin.sizes() ||
      cos.size(1) != x.size(1) || cos.size(2) != x.size(3) || (cos.size(0) != 1 && cos.size(0) != x.size(0))) {
    fail("rotary embedding: x {} against cos/sin {} (want [B, T, heads, D] and [B or 1, T, D])", c10::str(x.sizes()),
         c10::str(cos.sizes()));
  }
  auto c = cos.to(torch::kFloat32).contiguous();
  auto s = sin.to(torch::kFloat32).contiguous();
  return RotaryFunction::apply(x.contiguous(), c, s, static_cast<int64_t>(out));
}

torch::Tensor fused_swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  if (gate.sizes() != up.sizes() || gate.scalar_type() != up.scalar_type()) {
    fail("SwiGLU: gate {} {} and up {} {} differ", c10::str(gate.sizes()), c10::toString(gate.scalar_type()), c10::str(up.sizes()),
         c10::toString(up.scalar_type()));
  }
  return SwigluFunction::apply(gate.contiguous(), up.contiguous());
}

torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (weight.dim() != 1 || x.dim() < 1 || x.size(-1) != weight.size(0)) {
    fail("RMSNorm: x {} against weight {} (want [..., H] and [H])", c10::str(x.sizes()), c10::str(weight.sizes()));
  }
  if (x.is_cuda()) return std::get<0>(at::_fused_rms_norm(x, {weight.size(0)}, weight, eps));
  return RmsNormCpuFunction::apply(x.contiguous(), weight, eps);
}

}  // namespace replica::models
