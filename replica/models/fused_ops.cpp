// See fused_ops.h. Compiled with REPLICA_FUSED_KERNELS where LibTorch has CUDA and the CUDA
// compiler built replica/models/cuda/fused_kernels.cu (CMakeLists.txt); elsewhere
// fused_kernels_for() is false and nothing below the #ifdef is reached.
//
// Note [fused kernels]
// A Llama step on a GPU is not only GEMMs: the Kineto trace of the 503M bf16 step on an H100
// (bench/gpu_reports/h100-2026-11-26.md) spent 29.6 ms of 115 in cuBLAS and ~70 ms in ATen's
// elementwise kernels, the same kernels PyTorch eager runs. Per layer, HF's RMSNorm is six
// kernels each way (pow, mean, add, rsqrt, mul, mul), its rotary embedding five per tensor
// (two muls, neg, cat, add) over a transposed view, SwiGLU two, each writing a tensor autograd
// keeps. Three fused paths replace them, each one kernel forward and one backward:
//   RMSNorm  ATen's own at::_fused_rms_norm (CUDA, with its backward): fp32 statistics, one
//            rounding to the output dtype (HF rounds the normalised value, then multiplies by
//            the weight: in bf16 the two differ by at most one bf16 ulp; in fp32 by float
//            rounding). Taken when x and the weight share a dtype and the family multiplies by
//            the weight (Llama's and Olmo's styles; Gemma's 1 + w keeps the composite).
//   rotary   fused_kernels.cu: x [B, T, H, D] contiguous, read once, rotated in fp32, written in
//            the dtype attention consumes; under autocast that is the autocast dtype (what
//            SDPA would cast HF's fp32 result to, so the values are the same), else the
//            promotion of x's and cos's dtypes, as HF's x * cos. The backward applies the
//            transposed rotation; cos/sin need no gradient.
//   SwiGLU   fused_kernels.cu: silu(g) * u in fp32, rounded once; backward from g and u only
//            (HF keeps g, silu(g) and u).
//   loss     fused_kernels.cu: cross-entropy straight from the head's bf16 logits, one block per
//            token: an online logsumexp in fp32 forward, softmax - one_hot written in the
//            logits' dtype backward. The composite casts the logits to fp32 (a copy twice
//            their size), keeps fp32 log-probabilities and casts the gradient back.
// Measured on the H100 (bench/gpu_reports/h100-2026-11-26-fused.md, 503M Llama, 8 x 1024
// tokens): 70,017 -> 107,139 tokens/s under bf16 autocast, 79,871 -> 126,906 with bf16 weights.
// The CPU keeps the composite ops (its tests are bitwise against PyTorch's), and so does any
// tensor of an unsupported dtype or layout. The GPU tests (fused_gpu_test.cpp) hold each fused
// op to the composite within float rounding, forward and backward, fp32 and bf16.
#include "replica/models/fused_ops.h"

#include "replica/core/error.h"

#include <ATen/ATen.h>
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

bool set_fused_kernels(bool on) { return fused_switch().exchange(on); }

bool fused_kernels_for(const torch::Tensor& x) {
  return fused_kernels_compiled() && x.defined() && x.is_cuda() && fused_switch().load(std::memory_order_relaxed);
}

torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return std::get<0>(at::_fused_rms_norm(x, {weight.size(0)}, weight, eps));
}

#ifdef REPLICA_FUSED_KERNELS

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
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
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::ScalarType out,
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

// One SwiGLU kernel: forward (dy undefined) gives {silu(g) * u}; backward gives {dg, du}.
variable_list swiglu_kernel(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& dy) {
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

// One cross-entropy kernel over logits [N, V]: forward (grad undefined) fills loss [N] and lse
// [N]; backward reads lse and the sum's gradient and returns dlogits.
torch::Tensor cross_entropy_kernel(const torch::Tensor& logits, const torch::Tensor& targets, const torch::Tensor& lse,
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

struct CrossEntropySumFunction : torch::autograd::Function<CrossEntropySumFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets) {
    const auto fp32 = logits.options().dtype(torch::kFloat32);
    auto loss = torch::empty({logits.size(0)}, fp32);
    auto lse = torch::empty({logits.size(0)}, fp32);
    cross_entropy_kernel(logits, targets, lse, loss, torch::Tensor());
    ctx->save_for_backward({logits, targets, lse});
    return loss.sum();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto grad = grads[0].to(torch::kFloat32).contiguous();
    return {cross_entropy_kernel(saved[0], saved[1], saved[2], torch::Tensor(), grad), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fused_cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets) {
  if (logits.dim() != 2 || targets.dim() != 1 || targets.size(0) != logits.size(0)) {
    fail("cross-entropy: logits {} and targets {} (want [N, V] and [N])", c10::str(logits.sizes()),
         c10::str(targets.sizes()));
  }
  return CrossEntropySumFunction::apply(logits.contiguous(), targets.to(torch::kInt64).contiguous());
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

#else

torch::Tensor fused_rotary(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, torch::ScalarType) {
  fail("rotary embedding: this build has no CUDA kernels (LibTorch without CUDA)");
}

torch::Tensor fused_swiglu(const torch::Tensor&, const torch::Tensor&) {
  fail("SwiGLU: this build has no CUDA kernels (LibTorch without CUDA)");
}

torch::Tensor fused_cross_entropy_sum(const torch::Tensor&, const torch::Tensor&) {
  fail("cross-entropy: this build has no CUDA kernels (LibTorch without CUDA)");
}

#endif

}  // namespace replica::models
