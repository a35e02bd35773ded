// x W^T + b for the weights of model layers (LoraLinear's base, the tied head): LibTorch's
// torch::linear, except for fp32 on a CPU whose GEMMs replica gives to OpenBLAS
// (core/cpu_gemm.h, Note [OpenBLAS for CPU GEMMs on non-Intel CPUs]). There an autograd
// function makes the three products (forward, input gradient, weight gradient) through
// cpu_sgemm and saves what torch::linear saves (the input and the weight), so memory, gradient
// accumulation, activation checkpointing and frozen weights (no weight gradient computed)
// behave as before. Values agree with torch::linear's to fp32 rounding (another summation
// order), not bit for bit; with REPLICA_CPU_GEMM=aten they are torch::linear's.
//
// Everything else takes torch::linear: CUDA, bf16/fp16, autocast on, empty inputs, weights
// that are not contiguous, sizes beyond OpenBLAS's 32-bit ones. Not twice differentiable on
// the OpenBLAS path (no model layer needs it).
#pragma once

#include <torch/types.h>

namespace replica::models {

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});

// Whether `linear` takes the OpenBLAS path for these tensors (for tests and benchmarks).
bool linear_uses_openblas(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});

}  // namespace replica::models
