// A checkpoint's optimizer state (optimizer.safetensors) looked up by tensor name, for the
// loaders of each optimizer (optim.cpp, optim_8bit.cpp, adafactor.cpp): one lookup, one shape
// check naming the tensor, and one count of what was taken, so that a loader can refuse state
// that matches no parameter instead of dropping it.
#pragma once

#include "replica/core/error.h"
#include "replica/io/safetensors.h"

#include <torch/types.h>

#include <cstddef>
#include <map>
#include <string>

namespace replica::train {

class SavedOptimizerState {
 public:
  // How a saved tensor must match the state it restores: the same shape, or the same number of
  // elements (AdamW8bit keeps its state flat).
  enum class Match { Shape, Elements };

  explicit SavedOptimizerState(const io::NamedTensors& state) : by_name_(state.begin(), state.end()) {}

  // The tensor `name`, undefined when the checkpoint has none. With `like` defined, one that does
  // not match it is a replica::Error naming the tensor and `whose` shape it should have had.
  torch::Tensor take(const std::string& name, const torch::Tensor& like, Match match = Match::Shape,
                     const char* whose = "the parameter") {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) return {};
    const bool matches = !like.defined() || (match == Match::Shape ? it->second.sizes() == like.sizes()
                                                                   : it->second.numel() == like.numel());
    if (!matches) {
      fail("optimizer state '{}' has shape {} but {} has {}", name, c10::str(it->second.sizes()), whose,
           c10::str(like.sizes()));
    }
    ++used_;
    return it->second;
  }

  // Tensors taken so far, and all there are.
  size_t used() const { return used_; }
  size_t size() const { return by_name_.size(); }

 private:
  std::map<std::string, torch::Tensor> by_name_;
  size_t used_ = 0;
};

}  // namespace replica::train
