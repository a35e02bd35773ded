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
// through the fp32 GEMM instead (cpu_half_matmul; Note [bf16 GEMMs through fp32 on CPUs without
// bf16 arithmetic] in linear.cpp), with the same saved tensors and the same rounding points, and
// so does fp16 on a CPU without fp16 arithmetic (neither AVX512-FP16 nor AMX-FP16: AMD's
// EPYCs to date, Intel's before Sapphire Rapids), where ATen's fp16 GEMM is a generic loop some
// 60x slower than fp32's (Note [fp16 GEMMs through fp32 on CPUs without fp16 arithmetic]): fp16
// operands, products summed in fp32, one rounding to fp16, as a GPU's fp16 GEMM under autocast.
//
// Everything else takes torch::linear: CUDA, half types on CPUs that do their arithmetic, empty
// inputs, weights that are not contiguous, sizes beyond OpenBLAS's 32-bit ones. Not twice
// differentiable on the OpenBLAS and half-type paths (no model layer needs it).
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
// The same for fp16: true where the CPU has neither AVX512-FP16 nor AMX-FP16, unless
// REPLICA_CPU_FP16_GEMM=aten (fp32 forces it on). On a CPU with them ATen's fp16 kernels
// (oneDNN) stay, unmeasured, as bf16's do on a CPU with AVX512-BF16.
bool cpu_fp16_through_fp32();
bool set_cpu_fp16_through_fp32(bool on);
// Whether the CPU does `dtype`'s arithmetic itself (bf16: AVX512-BF16 or AMX-BF16; fp16:
// AVX512-FP16 or AMX-FP16; any other type: true), whatever the switches say.
bool cpu_does_half_arithmetic(at::ScalarType dtype);
// Whether `dtype`'s CPU products go through the fp32 GEMM: the switch above for bf16 or fp16,
// false for any other type.
bool cpu_half_through_fp32(at::ScalarType dtype);
// a [M, K] times b [K, N], CPU tensors of one half type (bf16 or fp16) and any strides, with
// `bias` [N] (the same type, optional) added: what a GEMM of that type with fp32 accumulation
// gives, computed by the fp32 GEMM a block of b's columns at a time and rounded to the half type
// once. No autograd.
torch::Tensor cpu_half_matmul(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias = {});
// x [..., K] times w [K, N]: at::matmul, except bf16 or fp16 operands (both of one type, w 2-D)
// on a CPU without that type's arithmetic, which go through cpu_half_matmul (the same values).
// For products that are no layer's forward: a quantized base's dequantized weight, LoRA's adapter
// gradients, FusedLinear's products.
torch::Tensor dtype_matmul(const torch::Tensor& x, const torch::Tensor& w);

}  // namespace replica::models
