// Tensors whose memory is a file on disk: DeepSpeed's NVMe offload (`offload_optimizer_device:
// nvme`, `offload_param_device: nvme`) for a host that has less RAM than the state it trains.
//
// Why a memory-mapped file and not DeepSpeed's explicit swap-in/swap-out buffers: the optimizer
// step and ZeRO-3's gathers read the state as ordinary tensors, in the order they were laid
// out, once per step. With MAP_SHARED the kernel pages the file in ahead of that sequential
// read (readahead) and writes dirty pages back and evicts them under memory pressure, so the
// resident part of the state is what the page cache can spare, and nothing else changes: the
// same kernels run on the same bytes, so a run with its state in files computes exactly what
// the run with its state in RAM computes. The file is unlinked as soon as it is mapped: it
// takes disk space only while the process lives and is gone after any exit, crash included
// (a swap file left behind by a killed run would otherwise fill the disk).
//
// Written by hand: no Debian package maps a file as a tensor (LibTorch's from_file reads
// through a shared mapping but cannot create, size or unlink the file).
#pragma once

#include <torch/types.h>

#include <string>

namespace replica {

// Zeros of `shape` and `dtype` on the CPU whose storage is a new file in `dir` (created if
// missing). replica::Error naming the directory when it cannot be written or the disk is full
// (the space is reserved up front with posix_fallocate, so a full disk is an error here and
// not a SIGBUS later).
torch::Tensor file_backed_zeros(const std::string& dir, at::IntArrayRef shape, torch::ScalarType dtype);

// Whether `t`'s memory lies in a file made by file_backed_zeros.
bool is_file_backed(const torch::Tensor& t);

}  // namespace replica
