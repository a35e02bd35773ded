// The language-model head and its cross-entropy in one, a chunk of tokens at a time, so the
// [tokens, vocab] logits never exist whole (Liger's and Unsloth's fused linear cross-entropy).
//
// Why: at sequence 2048 and Llama 3's 128k vocabulary the fp32 logits are 1 GiB, and the plain
// path keeps three such tensors alive across the step (the logits, the log-softmax autograd
// saves, their gradient): more than the activations of every checkpointed decoder layer
// together. Here the forward keeps one fp32 log-sum-exp per token; the backward recomputes
// each chunk's logits (one more [chunk, H] x [H, V] matmul per chunk, ~1/(3 x layers) of the
// step's FLOPs) and turns them into the gradient right away: softmax - one_hot, scaled.
// Numerically: the logits are computed as the head computes them (autocast's dtype where it is
// on in the forward, else the hidden states'; fp32 accumulation; Note [the head's product
// dtype] in the .cpp), cast to fp32, and reduced in fp32, as transformers' ForCausalLMLoss
// does after `logits.float()`; sums of chunks instead of one sum, so equal to the plain path
// within float rounding.
#pragma once

#include <torch/types.h>

namespace replica::models {

// sum over t with targets[t] != -100 of -log softmax(hidden[t] W^T + b)[targets[t]] (fp32
// scalar, differentiable in hidden, weight and bias). hidden [N, H], weight [V, H], bias [V]
// or undefined, targets [N] int64; `chunk` tokens per piece (<= 0: all at once).
torch::Tensor linear_cross_entropy_sum(const torch::Tensor& hidden, const torch::Tensor& weight,
                                       const torch::Tensor& bias, const torch::Tensor& targets, int64_t chunk);

}  // namespace replica::models
