// The `params:` keys every task has: run control, the engine, the training loop (their fields
// are RunParams, run_config.h; each task's own keys are beside its workload, replica/tasks/).
#include "replica/train/deepspeed_config.h"
#include "replica/train/keys.h"
#include "replica/train/run_config.h"
#include "replica/train/schedule.h"
#include "replica/train/task.h"

#include <fmt/format.h>

#include <string>
#include <vector>

namespace replica::train {

// ---------------------------------------------------------------------------------------
// The keys every task has.

const std::vector<KeySpec>& common_keys() {
  static const std::vector<KeySpec> keys = [] {
    using P = RunParams;
    auto zero3 = [](const RunConfig& c) { return zero_stage_of(c.params) == 3; };
    std::vector<KeySpec> k = {
        // Workers and rendezvous.
        key("distributed_backend", &P::distributed_backend,
            "ddp: replicas, gradients all-reduced during backward; zero3 (deepspeed): parameters, gradients "
            "and optimizer state sharded")
            .group("Workers")
            .null_is(DistributedBackend::Ddp)
            .alias("deepspeed", DistributedBackend::Zero3)
            .shown("null, ddp, deepspeed, zero3"),
        key("device", &P::device,
            "where each worker computes: cuda (cuda:LOCAL_RANK, NCCL between workers), cpu (Gloo), or auto "
            "(cuda when a GPU is visible)")
            .group("Workers"),
        key("ddp_backend", &P::ddp_backend,
            "process-group backend (transformers' name): auto (NCCL between GPUs, Gloo on the CPU), nccl, or gloo "
            "(with GPUs too: Gloo moves CUDA tensors through the host, and several workers may share a GPU)")
            .group("Workers")
            .one_of({"auto", "nccl", "gloo"})
            .null_is("auto"),
        key("nproc_per_node", &P::nproc_per_node, "workers on this node (auto: usable cores, or visible GPUs)")
            .group("Workers")
            .keyword("auto", 0)
            .valid_if([](const int& v) { return v >= 1; }, "a positive integer or 'auto'"),
        key("master_addr", &P::master_addr, "rendezvous host (rank 0's node)").group("Workers").not_empty(),
        key("master_port", &P::master_port, "rendezvous port (0: a free one, one node only)")
            .group("Workers")
            .check([](const int& v) {
              return v < 0 || v > 65535 ? fmt::format("must be a port number 0-65535, got {}", v) : std::string();
            }),
        key("rdzv_timeout", &P::rdzv_timeout, "seconds to wait for every worker at the rendezvous")
            .group("Workers")
            .positive(),
        key("collective_timeout", &P::collective_timeout,
            "seconds a collective may wait for a peer before the run stops naming it")
            .group("Workers")
            .positive(),
        key("max_restarts", &P::max_restarts, "restarts of the worker group after a failure")
            .group("Workers")
            .at_least(0),
        key("deterministic", &P::deterministic, "same inputs, same bits, at any run and after any resume")
            .group("Workers"),
        key("stage3_prefetch_bucket_size", &P::stage3_prefetch_bucket_size,
            "zero3: elements gathered ahead of use")
            .group("ZeRO-3")
            .at_least(0.0)
            .in_json_when(zero3),
        key("stage3_param_persistence_threshold", &P::stage3_param_persistence_threshold,
            "zero3: layers smaller than this stay gathered")
            .group("ZeRO-3")
            .at_least(0.0)
            .in_json_when(zero3),
        key("stage3_max_live_parameters", &P::stage3_max_live_parameters, "zero3: elements gathered at once")
            .group("ZeRO-3")
            .at_least(0.0)
            .in_json_when(zero3),
        key("stage3_max_reuse_distance", &P::stage3_max_reuse_distance,
            "zero3: a layer whose backward comes within this many gathered elements of its forward stays gathered")
            .group("ZeRO-3")
            .at_least(0.0)
            .in_json_when(zero3),
        key("reduce_bucket_size", &P::reduce_bucket_size,
            "zero3: accepted for DeepSpeed configs (each layer's gradients are reduced whole)")
            .group("ZeRO-3")
            .at_least(0.0)
            .in_json_when(zero3),
        key("overlap_comm", &P::overlap_comm, "zero3: gather the next layer while this one computes")
            .group("ZeRO-3")
            .in_json_when(zero3),
        key("shard_optimizer", &P::shard_optimizer,
            "ddp: each worker steps only its 1/N of the parameters (ZeRO-1/2 inside DDP); auto: on for CPU "
            "workers sharing one host")
            .group("Workers"),
        // DeepSpeed's memory knobs, by DeepSpeed's names (Note [ZeRO stages] in engine.cpp).
        key("zero_stage", &P::zero_stage,
            "1: optimizer state sharded; 2: + gradients (reduce-scattered); 3: + parameters (zero3); 0: plain "
            "ddp; auto: 3 for deepspeed/zero3, 0 for ddp")
            .group("ZeRO")
            .hint("0|1|2|3")
            .keyword("auto", -1)
            .null_is(-1)
            .valid_if([](const int& v) { return v >= 0 && v <= 3; }, "0, 1, 2, 3 or 'auto'"),
        key("offload_optimizer_device", &P::offload_optimizer_device,
            "optimizer state and step on the host (cpu) or in files under nvme_path (nvme); zero_stage >= 1")
            .group("ZeRO")
            .null_is(OffloadDevice::None),
        key("offload_param_device", &P::offload_param_device,
            "zero_stage 3: parameter shards on the host (cpu) or in files under nvme_path (nvme)")
            .group("ZeRO")
            .null_is(OffloadDevice::None),
        key("nvme_path", &P::nvme_path, "directory of the nvme offload's swap files (a fast local disk)")
            .group("ZeRO"),
        key("deepspeed", &P::deepspeed,
            "a DeepSpeed JSON config (ds_config.json), read into these keys; a field replica does not implement "
            "is an error")
            .group("ZeRO"),
        key("token", &P::token,
            "rendezvous secret (or env REPLICA_TOKEN); never written out (AutoTrain's Hub token is read here, "
            "and replica reaches no Hub)")
            .group("Workers")
            .null_is("")
            .secret(),
        // The training loop.
        key("epochs", &P::epochs, "passes over the training data").group("Training").at_least(1).known_as(
            {"num_train_epochs"}),
        key("max_steps", &P::max_steps, "optimizer steps; wins over epochs (-1: off)")
            .group("Training")
            .off_or_at_least(-1, 1, "off"),
        key("batch_size", &P::batch_size, "samples per worker per micro-step")
            .group("Training")
            .at_least(1)
            .known_as({"per_device_train_batch_size", "train_batch_size"}),
        key("gradient_accumulation", &P::gradient_accumulation, "micro-steps per optimizer step")
            .group("Training")
            .at_least(1)
            .known_as({"gradient_accumulation_steps"}),
        key("mixed_precision", &P::mixed_precision,
            "bf16: autocast compute, fp32 master weights; fp16: the same in float16, with dynamic loss scaling")
            .group("Training")
            .null_is(Precision::Fp32)
            .alias("no", Precision::Fp32)  // Accelerate's spelling
            .alias("none", Precision::Fp32)
            .known_as({"precision"}),
        key("optimizer", &P::optimizer,
            "fused AdamW, SGD with momentum, AdamW with 8-bit block-wise state (bitsandbytes'; paged_: in "
            "CUDA managed memory on a GPU), or Adafactor (transformers' defaults)")
            .group("Training")
            .alias("adamw_torch", OptimizerKind::AdamW)  // AutoTrain's default spelling
            .alias("adamw_torch_fused", OptimizerKind::AdamW)
            .alias("adamw_hf", OptimizerKind::AdamW)  // older transformers' own AdamW: the same update
            .alias("adamw_8bit", OptimizerKind::AdamW8bit)  // transformers: an alias of adamw_bnb_8bit
            .known_as({"optim"}),
        key("lr", &P::lr, "peak learning rate").group("Training").positive().known_as({"learning_rate"}),
        key("momentum", &P::momentum, "sgd's momentum").group("Training").at_least(0.0),
        key("weight_decay", &P::weight_decay, "decoupled weight decay").group("Training").at_least(0.0),
        key("warmup_steps", &P::warmup_steps, "linear warm-up steps (0: warmup_ratio)")
            .group("Training")
            .at_least(0),
        key("warmup_ratio", &P::warmup_ratio, "warm-up as a fraction of the steps")
            .group("Training")
            .fraction(),
        key("scheduler", &P::scheduler,
            "learning-rate schedule, transformers' get_scheduler formulas (constant: no warm-up; "
            "constant_with_warmup: warm-up, then constant; polynomial: lr_end 1e-7, power 1)")
            .group("Training")
            .known_as({"lr_scheduler_type"}),
        key("max_grad_norm", &P::max_grad_norm, "gradient clipping by global norm (<= 0: off)").group("Training"),
        key("nonfinite_loss", &P::nonfinite_loss,
            "a NaN/Inf loss or gradient norm on any worker: stop naming the step, or skip the step's update "
            "(counted, logged); fp16's loss scaler skips its overflows either way")
            .group("Training"),
        key("shuffle", &P::shuffle, "reshuffle the training data every epoch").group("Training"),
        key("seed", &P::seed, "seed of initialisation, shuffling and dropout").group("Training").at_least(0),
        key("eval_every", &P::eval_every, "evaluate every N steps (0: at the end of each epoch)")
            .group("Training")
            .at_least(0)
            .known_as({"eval_steps"}),
        key("eval_strategy", &P::eval_strategy,
            "epoch: at the end of each epoch (every eval_every steps when set); steps: every eval_every steps "
            "(logging_steps when 0); no: never (HF TrainingArguments' names)")
            .group("Training")
            .unused_when([](const RunConfig& c) {
              return c.data.valid_split ? std::string() : std::string("without a valid_split (nothing to evaluate)");
            }),
        key("checkpoint_every", &P::checkpoint_every,
            "a checkpoint every N steps and one at the end (0: no checkpoints at all, so nothing to resume "
            "from; final/ is still written)")
            .group("Training")
            .at_least(0)
            .synonym("save_steps")
            .unused_when([](const RunConfig& c) {
              return c.params.save_strategy == SaveStrategy::Steps
                         ? std::string()
                         : fmt::format("with save_strategy {}", name_of(c.params.save_strategy));
            }),
        key("save_strategy", &P::save_strategy,
            "steps: a checkpoint every checkpoint_every (save_steps) steps; epoch: at the end of each epoch; no: "
            "none (nothing to resume from; final/ is still written); steps and epoch also at the end")
            .group("Training"),
        key("resume_from_checkpoint", &P::resume_from_checkpoint,
            "auto (or null, true): continue from project_name's latest checkpoint when it has one; false: only "
            "a fresh start (an earlier run's checkpoints are an error); PROJECT/checkpoint-STEP: continue from "
            "that one")
            .group("Training")
            .null_is("")
            .keyword("auto", "")
            .alias("true", "")
            .alias("latest", ""),
        key("auto_find_batch_size", &P::auto_find_batch_size,
            "AutoTrain's batch-size search: not in replica (false only; set batch_size and gradient_accumulation)")
            .group("Training")
            .check([](const bool& v) {
              return v ? std::string("must be false: replica does not search for a batch size; set batch_size "
                                     "(and gradient_accumulation for the same global batch)")
                       : std::string();
            }),
        key("push_to_hub", &P::push_to_hub,
            "AutoTrain's upload to the Hugging Face Hub: not in replica (false only)")
            .group("Hub")
            .null_is(false)
            .check([](const bool& v) {
              return v ? std::string("must be false: replica does not upload to the Hugging Face Hub (a run's "
                                     "machines may reach no network); upload project_name/final afterwards, "
                                     "e.g. huggingface-cli upload USER/NAME PROJECT/final")
                       : std::string();
            }),
        key("username", &P::username, "AutoTrain's Hub user (no upload in replica: no effect)")
            .group("Hub")
            .null_is("")
            .unused_when([](const RunConfig& c) {
              return c.params.username.empty() ? std::string()
                                               : std::string("(replica does not upload to the Hugging Face Hub)");
            }),
        key("save_total_limit", &P::save_total_limit, "checkpoints kept (<= 0: all)").group("Training"),
        key("threads_per_worker", &P::threads_per_worker, "intra-op threads per worker (0: cores / workers)")
            .group("Workers")
            .at_least(0),
        key("logging_steps", &P::logging_steps, "a metrics line every N steps (-1: the default)")
            .group("Output")
            .alias("-1", RunParams{}.logging_steps)  // AutoTrain's "pick for me"
            .at_least(1),
        key("overwrite", &P::overwrite, "replace an earlier run's outputs in project_name (only those)")
            .group("Output"),
        key("timeline", &P::timeline, "write a Chrome trace of every rank to this file").group("Output"),
    };
    return k;
  }();
  return keys;
}

}  // namespace replica::train
