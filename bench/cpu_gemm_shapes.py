# Single-thread fp32 GEMM throughput at the LLM step's shapes (bench/llama_step.cpp's small
# preset: 1024 tokens, hidden 512, KV 256, SwiGLU 1376, vocabulary 8192; forward, input and
# weight gradient of each), three libraries in one process: MKL (torch.mm, LibTorch's own),
# BLIS and OpenBLAS (Debian's serial builds through their cblas_sgemm). Prints GFLOPS per
# shape and the total time of one product of each shape. Why replica multiplies model layers
# with OpenBLAS on AMD CPUs: replica/core/cpu_gemm.h.
#   OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_gemm_shapes.py   (needs libblis4-serial and
#   libopenblas0-serial; a missing one is left out)
import ctypes, time, sys, numpy as np, torch
torch.set_num_threads(1)
libs = {"blis": "/usr/lib/x86_64-linux-gnu/blis-serial/libblis.so.4",
        "openblas": "/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0"}
# Row-major C[M,N] = A[M,K] op B ; the step's shapes (tokens 1024, hidden 512)
shapes = []
for (n, k) in [(512, 512), (256, 512), (1376, 512), (512, 1376), (8192, 512)]:
    shapes.append(("fwd", 1024, n, k, False, True))     # X[M,K] W[N,K]^T
    shapes.append(("dX", 1024, k, n, False, False))     # dY[M,N] W[N,K]
    shapes.append(("dW", n, k, 1024, True, False))      # dY^T[N,M] X[M,K]
def bench_torch(M, N, K, ta, tb, reps):
    A = torch.randn(K, M).t() if ta else torch.randn(M, K)
    B = torch.randn(N, K).t() if tb else torch.randn(K, N)
    C = torch.empty(M, N)
    torch.mm(A, B, out=C)
    t = time.perf_counter()
    for _ in range(reps): torch.mm(A, B, out=C)
    return (time.perf_counter() - t) / reps
def bench_cblas(lib, M, N, K, ta, tb, reps):
    f = lib.cblas_sgemm
    A = np.random.randn(K, M).astype(np.float32) if ta else np.random.randn(M, K).astype(np.float32)
    B = np.random.randn(N, K).astype(np.float32) if tb else np.random.randn(K, N).astype(np.float32)
    C = np.empty((M, N), np.float32)
    P = ctypes.c_void_p
    args = (101, 112 if ta else 111, 112 if tb else 111, M, N, K, ctypes.c_float(1.0),
            P(A.ctypes.data), M if ta else K, P(B.ctypes.data), K if tb else N, ctypes.c_float(0.0), P(C.ctypes.data), N)
    f(*args)
    t = time.perf_counter()
    for _ in range(reps): f(*args)
    return (time.perf_counter() - t) / reps
L = {}
for k, v in libs.items():
    try:
        L[k] = ctypes.CDLL(v)
    except OSError:
        print(f"{k}: {v} not found, left out")
tot = {"mkl": 0, **{k: 0 for k in L}}
for name, M, N, K, ta, tb in shapes:
    fl = 2 * M * N * K
    reps = max(3, int(2e9 / fl))
    r = {"mkl": bench_torch(M, N, K, ta, tb, reps)}
    for k in L: r[k] = bench_cblas(L[k], M, N, K, ta, tb, reps)
    for k in r: tot[k] += r[k]
    print(f"{name} {M}x{N}x{K}: " + " ".join(f"{k} {fl / v / 1e9:.1f}" for k, v in r.items()))
print("total ms:", {k: round(v * 1e3, 2) for k, v in tot.items()})
