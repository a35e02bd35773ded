// safetensors: the only format replica reads or writes weights in (no pickle).
//
// Layout (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
// N bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"k": "v"}}, then the raw little-endian data; offsets are relative to the
// start of the data section. Every field is bounds-checked on read: a truncated or lying
// file is a replica::Error naming the file and the tensor, never a crash.
//
// Thread-safety: the functions share no state; concurrent reads of one file are safe,
// concurrent writes of one path are not (the last rename wins).
#pragma once

#include <torch/types.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace replica::io {

// Tensors in the order they were written (the header itself is a JSON object; readers sort
// by offset, which is the writing order for files replica writes).
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

struct SafetensorsFile {
  NamedTensors tensors;                          // sorted by data offset
  std::map<std::string, std::string> metadata;   // "__metadata__", string to string

  // The tensor named `name`; replica::Error naming the file and the tensor when absent.
  const torch::Tensor& at(const std::string& name) const;
  bool contains(const std::string& name) const;
  std::string path;
};

// Supported dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
// Writes atomically: to PATH.tmp.<pid>, fsync, rename over PATH, fsync the directory, so a
// crash mid-save leaves the previous file intact. Tensors may be non-contiguous (copied).
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// What load_safetensors does with a floating tensor holding NaN or an infinity.
enum class NonFinite {
  kRefuse,  // replica::Error naming the file and the tensor (weights, optimizer state, adapters)
  kKeep,    // read bit for bit (the format's own conformance test)
};

// Reads the whole file into CPU tensors (each owning its memory). Only a regular file is
// read (a FIFO is refused without blocking). Every floating tensor must be finite unless
// `non_finite` is kKeep: Note [finite weights] in safetensors.cpp.
SafetensorsFile load_safetensors(const std::string& path, NonFinite non_finite = NonFinite::kRefuse);

// One tensor as the header describes it, its data not read.
struct TensorHeader {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
};
// The header of PATH, checked exactly as load_safetensors checks it (offsets against the
// file's size included), in data order, without reading or allocating any tensor: what a
// loader compares a model's configuration against before it builds the model.
std::vector<TensorHeader> read_safetensors_header(const std::string& path);

}  // namespace replica::io
