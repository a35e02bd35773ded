// x W^T + b for the weights of model layers (LoraLinear's base, the tied head): LibTorch's
// torch::linear, except for fp32 on a CPU whose GEMMs replica gives to OpenBLAS
// (core/cpu_gemm.h, Note [OpenBLAS for CPU GEMMs on non-Intel CPUs]). There an autograd
// function makes the three products (forward, input gradient, weight gradient) through
// cpu_sgemm and saves what torch::linear saves (the input and the weight), so memory, gradient
// accumulation, activation checkpointing and frozen weights (no weight gradient computed)
// behave as before. Values agree with torch::linear's to fp32 rounding (another summation
// order), not bit for bit; with REPLICA_CPU_GEMM=aten they are torch::linear's.
//
// bf16 on a CPU without bf16 arithmetic (bf16 tensors, or CPU autocast to bf16) multiplies
// through the fp32 GEMM instead (cpu_bf16_matmul; Note [bf16 GEMMs through fp32 on CPUs without
// bf16 arithmetic] in linear.cpp), with the same saved tensors and the same rounding points.
//
// Everything else takes torch::linear: CUDA, fp16, empty inputs, weights that are not
// contiguous, sizes beyond OpenBLAS's 32-bit ones. Not twice differentiable on the OpenBLAS
// and bf16 paths (no model layer needs it).
#pragma once

#include <torch/types.h>

namespace replica::models {

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});

// Whether `linear` takes the OpenBLAS path for these tensors (for tests and benchmarks).
bool linear_uses_openblas(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});

// Whether bf16 products on the CPU go through the fp32 GEMM: true where the CPU has neither
// AVX512-BF16 nor AMX-BF16, unless REPLICA_CPU_BF16_GEMM=aten (fp32 forces it on). Decided once
// per process; set_cpu_bf16_through_fp32 changes it (tests) and returns the previous setting.
bool cpu_bf16_through_fp32();
bool set_cpu_bf16_through_fp32(bool on);
// a [M, K] times b [K, N], bf16 CPU tensors of any strides, with `bias` [N] (bf16, optional)
// added: what a bf16 GEMM with fp32 accumulation gives, computed by the fp32 GEMM a block of
// b's columns at a time and rounded to bf16 once. No autograd.
torch::Tensor cpu_bf16_matmul(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias = {});
// x [..., K] times w [K, N]: at::matmul, except bf16 operands on a CPU without bf16
// arithmetic, which go through cpu_bf16_matmul (the same values). For products that are no layer's forward: a quantized base's dequantized weight,
// LoRA's adapter gradients.
torch::Tensor dtype_matmul(const torch::Tensor& x, const torch::Tensor& w);

}  // namespace replica::models
