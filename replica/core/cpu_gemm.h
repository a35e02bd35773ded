// The CPU's fp32 GEMM for the weights of LLM layers: the one decision of which library
// multiplies them on the CPU, and the call.
//
// Note [OpenBLAS for CPU GEMMs on non-Intel CPUs]
// LibTorch's CPU matmul is MKL's sgemm, statically linked into libtorch_cpu. MKL is Intel's,
// tuned for Intel's cores; on the AMD EPYC cores of this project's machines Debian's OpenBLAS
// (0.3.21, DYNAMIC_ARCH: its Zen kernels) measured 1.12x MKL's throughput, single-threaded,
// summed over the shapes of an LLM step (tokens x hidden x {hidden, KV, SwiGLU, vocabulary},
// forward and both gradients; 467 against 525 ms, bench/README.md), and up to 1.32x on the
// output head's [tokens, vocabulary] product. So on CPUs that are not Intel's, replica's
// model layers (models/linear.h) take OpenBLAS, and MKL stays where it is Intel's own.
//
// How OpenBLAS is reached: dlopen of Debian's single-threaded build (libopenblas0-serial,
// which scripts/setup.sh installs), RTLD_LOCAL | RTLD_DEEPBIND, and cblas_sgemm taken from that
// handle. libtorch_cpu exports MKL's BLAS symbols (sgemm_, cblas_sgemm_*), so linking OpenBLAS
// normally would leave which library answers a call to the loader's search order; a private
// handle cannot be interposed. No library found: MKL, as before (a CPU-only or non-Debian
// build needs nothing more). The serial build starts no threads of its own: with more than one
// intra-op thread, cpu_sgemm splits the product into row (or column) blocks over LibTorch's
// own pool (at::parallel_for), so there is one thread pool in the process, not two spinning
// against each other on the same cores. Each block is a whole product of its rows, so a result
// depends on the thread count only through which rows a block holds: the same threads, the
// same bits.
//
// REPLICA_CPU_GEMM=auto (default) | openblas | aten overrides the choice (openblas where it
// cannot be loaded is an error naming the variable); REPLICA_OPENBLAS names another
// libopenblas to load.
#pragma once

#include <cstdint>
#include <string>

namespace replica {

// True when fp32 GEMMs of model layers on the CPU go through cpu_sgemm (OpenBLAS), false when
// they stay with LibTorch (MKL). Decided once per process; see the Note above.
bool cpu_gemm_is_openblas();

// What `replica env` prints: "OpenBLAS 0.3.21 ... (auto: AMD CPU)", "LibTorch (MKL) (auto: Intel
// CPU)", "LibTorch (MKL) (REPLICA_CPU_GEMM=aten)", ...
std::string cpu_gemm_description();

// Row-major C[M, N] = op(A) op(B) + beta C, op(X) = X or X^T as trans_*; lda, ldb, ldc are the
// row strides of A, B and C as stored. Only when cpu_gemm_is_openblas(); split over LibTorch's
// intra-op threads.
void cpu_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace replica
