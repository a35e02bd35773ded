#include "replica/train/deepspeed_config.h"

#include "replica/core/error.h"
#include "replica/core/text.h"
#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/train/loss_scale.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <set>

namespace replica::train {
namespace {

using json = nlohmann::json;

// The widest integer a field is read as: a double holds every integer up to 2^53 exactly, so
// a value checked against this (or a narrower type's maximum) converts without wrapping.
constexpr int64_t kMaxExactInteger = int64_t{1} << 53;
constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
// DeepSpeed configs are a few KB.
constexpr std::uint64_t kMaxDeepSpeedJsonBytes = std::uint64_t{16} << 20;

// Note [DeepSpeed config]
// What each field of a DeepSpeed config becomes ("auto" always leaves replica's value, as the
// transformers Trainer fills "auto" from its own arguments):
//   train_micro_batch_size_per_gpu      batch_size
//   gradient_accumulation_steps         gradient_accumulation
//   train_batch_size                    checked = batch_size x gradient_accumulation x workers,
//                                       when the workers are known (make_engine)
//   gradient_clipping                   max_grad_norm
//   bf16.enabled / fp16.enabled         mixed_precision bf16 / fp16 (fp16's loss-scaler fields
//                                       must be what replica's scaler does: loss_scale.h)
//   optimizer {Adam, AdamW}             optimizer adamw, lr, weight_decay (betas (0.9, 0.999),
//                                       eps 1e-8: the values replica's AdamW uses)
//   scheduler {WarmupLR, WarmupDecayLR, WarmupCosineLR}
//                                       scheduler constant / linear / cosine, warmup_steps, lr
//   zero_optimization.stage             zero_stage (3 also sets distributed_backend zero3;
//                                       without a stage, distributed_backend decides as usual)
//   zero_optimization.offload_optimizer / offload_param {device, nvme_path, pin_memory}
//                                       offload_*_device, nvme_path (pinned host buffers on CUDA)
//   zero_optimization.{overlap_comm, reduce_bucket_size, stage3_prefetch_bucket_size,
//     stage3_param_persistence_threshold, stage3_max_live_parameters,
//     stage3_max_reuse_distance}        the keys of those names
// Fields that ask for what replica always does are accepted with that value only:
// contiguous_gradients, allgather_partitions and reduce_scatter true (flat buffers, gathered
// whole, reduce-scattered at stage 2), stage3_gather_16bit_weights_on_model_save true (final/
// is always the gathered model), wall_clock_breakdown false. Accepted without a counterpart:
// steps_per_print (DeepSpeed's console line; replica logs every logging_steps),
// zero_allow_untested_optimizer and zero_force_ds_cpu_optimizer (permissions, nothing to do),
// sub_group_size (the granularity of DeepSpeed's optimizer step; replica's fused step works one
// shard tensor at a time and keeps no per-group buffers). Everything else is an error naming
// the field: a DeepSpeed run and a replica run with the same file must not quietly differ.
class Reader {
 public:
  Reader(RunConfig& c, const KeyLocation& loc, std::string file) : c_(c), loc_(loc), file_(std::move(file)) {}

  void read(const json& root) {
    if (!root.is_object()) fail("{}: a DeepSpeed config must be a JSON object", file_);
    for (auto it = root.begin(); it != root.end(); ++it) {
      const std::string& f = it.key();
      const json& v = it.value();
      if (f == "train_micro_batch_size_per_gpu") {
        if (const auto n = integer(f, v, 1, kMaxInt)) set("batch_size", c_.params.batch_size, static_cast<int>(*n), f);
      } else if (f == "gradient_accumulation_steps") {
        if (const auto n = integer(f, v, 1, kMaxInt)) {
          set("gradient_accumulation", c_.params.gradient_accumulation, static_cast<int>(*n), f);
        }
      } else if (f == "train_batch_size") {
        if (const auto n = integer(f, v, 1, kMaxExactInteger)) c_.params.deepspeed_train_batch_size = *n;
      } else if (f == "gradient_clipping") {
        if (const auto x = number(f, v)) set("max_grad_norm", c_.params.max_grad_norm, *x, f);
      } else if (f == "bf16" || f == "fp16") {
        precision(f, v);
      } else if (f == "optimizer") {
        optimizer(v);
      } else if (f == "scheduler") {
        scheduler(v);
      } else if (f == "zero_optimization") {
        zero(v);
      } else if (f == "wall_clock_breakdown") {
        require_value(f, v, false, "replica's timeline (--timeline FILE) is its wall-clock breakdown");
      } else if (f == "steps_per_print" || f == "zero_allow_untested_optimizer" || f == "zero_force_ds_cpu_optimizer") {
        // Accepted: nothing replica does depends on them (Note [DeepSpeed config]).
      } else {
        unsupported(f);
      }
    }
    check_precision_pair();
  }

 private:
  // The one message that shows a key the file made up (every other names a field replica
  // knows): at most 80 characters of it, however long the key (found by fuzz_deepspeed: a
  // 4 KB key came back whole).
  [[noreturn]] void unsupported(const std::string& field) const {
    fail("{}: field '{}' is not implemented by replica (the fields it reads are listed in docs/yaml.md, "
         "\"DeepSpeed config\"); remove it",
         file_, excerpt(field));
  }

  static bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

  // A value as messages show it: a string in quotes, cut to 60 characters; else json_excerpt.
  static std::string shown(const json& v) {
    if (!v.is_string()) return json_excerpt(v);
    const std::string& text = v.get_ref<const std::string&>();
    return "'" + (text.size() <= 60 ? text : text.substr(0, 60) + "...") + "'";
  }

  std::optional<double> number(const std::string& field, const json& v) const {
    if (is_auto(v)) return std::nullopt;
    if (!v.is_number()) fail("{}: field '{}' must be a number or \"auto\", got {}", file_, field, json_excerpt(v));
    const double x = v.get<double>();
    if (!std::isfinite(x)) fail("{}: field '{}' must be a finite number, got {}", file_, field, json_excerpt(v));
    return x;
  }

  // Every integer field is read here: range-checked as a double, then narrowed, so that 1e18
  // is an error naming the field instead of a wrapped batch size.
  std::optional<int64_t> integer(const std::string& field, const json& v, int64_t min, int64_t max) const {
    const auto x = number(field, v);
    if (!x) return std::nullopt;
    if (std::floor(*x) != *x || *x < static_cast<double>(min) || *x > static_cast<double>(max)) {
      fail("{}: field '{}' must be an integer from {} to {}, got {}", file_, field, min, max, json_excerpt(v));
    }
    return static_cast<int64_t>(*x);
  }

  std::optional<bool> boolean(const std::string& field, const json& v) const {
    if (is_auto(v)) return std::nullopt;
    if (!v.is_boolean()) {
      fail("{}: field '{}' must be true, false or \"auto\", got {}", file_, field, json_excerpt(v));
    }
    return v.get<bool>();
  }

  // A field accepted only with the value replica's behaviour matches.
  void require_value(const std::string& field, const json& v, const json& wanted, const std::string& why) const {
    if (is_auto(v) || v == wanted) return;
    fail("{}: field '{}' is {}; replica supports only {} ({})", file_, field, json_excerpt(v), json_excerpt(wanted),
         why);
  }

  const json& object(const std::string& field, const json& v) const {
    if (!v.is_object()) fail("{}: field '{}' must be a JSON object, got {}", file_, field, json_excerpt(v));
    return v;
  }

  // Sets params.KEY from the file, unless the YAML file or a flag gave it another value.
  template <class T>
  void set(const std::string& key, T& target, const T& value, const std::string& field) {
    const std::string path = "params." + key;
    if (loc_.has(path) && !(target == value)) {
      fail("{}: field '{}' is {} but {}key '{}' is {}; give one of them", file_, field, show(value),
           loc_.where(path), path, show(target));
    }
    target = value;
  }
  template <class T>
  static std::string show(const T& v) {
    if constexpr (std::is_enum_v<T>) {
      return name_of(v);
    } else if constexpr (std::is_same_v<T, std::string>) {
      return "'" + v + "'";
    } else {
      return fmt::format("{}", v);
    }
  }

  void precision(const std::string& f, const json& v) {
    object(f, v);
    const Precision mine = f == "bf16" ? Precision::Bf16 : Precision::Fp16;
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string field = f + "." + it.key();
      const json& x = it.value();
      if (it.key() == "enabled") {
        const auto on = boolean(field, x);
        if (!on) continue;
        (f == "bf16" ? bf16_ : fp16_) = *on;
        if (*on) {
          set("mixed_precision", c_.params.mixed_precision, mine, field);
        } else if (c_.params.mixed_precision == mine) {
          set("mixed_precision", c_.params.mixed_precision, Precision::Fp32, field);
        }
      } else if (f == "fp16" && it.key() == "loss_scale") {
        require_value(field, x, 0, "0 is the dynamic loss scaling replica's fp16 uses");
      } else if (f == "fp16" && it.key() == "initial_scale_power") {
        fp16_fields_.push_back({field, x, std::log2(LossScaler::kInitialScale), "replica's loss scale starts at 2^16"});
      } else if (f == "fp16" && it.key() == "loss_scale_window") {
        fp16_fields_.push_back({field, x, static_cast<double>(LossScaler::kGrowthInterval),
                                "replica's loss scale doubles after 2000 steps without overflow"});
      } else if (f == "fp16" && it.key() == "hysteresis") {
        fp16_fields_.push_back({field, x, 1.0, "replica's loss scale halves at the first overflow"});
      } else if (f == "fp16" && it.key() == "min_loss_scale") {
        fp16_fields_.push_back({field, x, 1.0, "replica's loss scale has no floor other than 1"});
      } else if (f == "fp16" && it.key() == "auto_cast") {
        // Autocast is how replica runs fp16 (the model stays fp32): either value trains the same.
      } else {
        unsupported(field);
      }
    }
  }

  // The fp16 scaler's fields matter only when fp16 is what the run uses.
  void check_precision_pair() const {
    if (bf16_ && fp16_ && *bf16_ && *fp16_) fail("{}: bf16.enabled and fp16.enabled are both true; pick one", file_);
    if (c_.params.mixed_precision != Precision::Fp16) return;
    for (const auto& f : fp16_fields_) {
      if (is_auto(f.value)) continue;
      if (!f.value.is_number() || f.value.get<double>() != f.wanted) {
        fail("{}: field '{}' is {}; replica supports only {} ({})", file_, f.field, json_excerpt(f.value), f.wanted,
             f.why);
      }
    }
  }

  void optimizer(const json& v) {
    object("optimizer", v);
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (it.key() == "type") {
        const std::string type = it.value().is_string() ? it.value().get<std::string>() : std::string();
        std::string lower = type;
        for (auto& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        // DeepSpeed's Adam is AdamW unless adam_w_mode is false.
        if (lower != "adamw" && lower != "adam") {
          fail("{}: optimizer.type {} is not implemented by replica (Adam/AdamW; or leave out the optimizer "
               "section and set params.optimizer)",
               file_, shown(it.value()));
        }
        set("optimizer", c_.params.optimizer, OptimizerKind::AdamW, "optimizer.type");
      } else if (it.key() == "params") {
        const json& p = object("optimizer.params", it.value());
        for (auto q = p.begin(); q != p.end(); ++q) {
          const std::string field = "optimizer.params." + q.key();
          if (q.key() == "lr") {
            if (const auto x = number(field, q.value())) set("lr", c_.params.lr, *x, field);
          } else if (q.key() == "weight_decay") {
            if (const auto x = number(field, q.value())) set("weight_decay", c_.params.weight_decay, *x, field);
          } else if (q.key() == "betas") {
            require_value(field, q.value(), json::array({0.9, 0.999}), "AdamW's default betas, which replica uses");
          } else if (q.key() == "eps") {
            require_value(field, q.value(), 1e-8, "AdamW's default eps, which replica uses");
          } else if (q.key() == "adam_w_mode" || q.key() == "bias_correction") {
            require_value(field, q.value(), true, "replica's optimizer is AdamW with bias correction");
          } else if (q.key() == "torch_adam") {
            // Which kernel DeepSpeed runs; replica always runs ATen's fused AdamW.
          } else {
            unsupported(field);
          }
        }
      } else {
        unsupported("optimizer." + it.key());
      }
    }
  }

  void scheduler(const json& v) {
    object("scheduler", v);
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (it.key() == "type") {
        const std::string type = it.value().is_string() ? it.value().get<std::string>() : std::string();
        SchedulerKind kind;
        if (type == "WarmupLR") {
          kind = SchedulerKind::ConstantWithWarmup;  // warm-up, then constant
        } else if (type == "WarmupDecayLR") {
          kind = SchedulerKind::Linear;
        } else if (type == "WarmupCosineLR") {
          kind = SchedulerKind::Cosine;
        } else {
          fail("{}: scheduler.type {} is not implemented by replica (WarmupLR, WarmupDecayLR, WarmupCosineLR)",
               file_, shown(it.value()));
        }
        set("scheduler", c_.params.scheduler, kind, "scheduler.type");
      } else if (it.key() == "params") {
        const json& p = object("scheduler.params", it.value());
        for (auto q = p.begin(); q != p.end(); ++q) {
          const std::string field = "scheduler.params." + q.key();
          const json& x = q.value();
          if (q.key() == "warmup_num_steps") {
            if (const auto n = integer(field, x, 0, kMaxExactInteger)) {
              set("warmup_steps", c_.params.warmup_steps, *n, field);
            }
          } else if (q.key() == "warmup_max_lr") {
            if (const auto lr = number(field, x)) set("lr", c_.params.lr, *lr, field);
          } else if (q.key() == "warmup_min_lr" || q.key() == "warmup_min_ratio" || q.key() == "cos_min_ratio") {
            require_value(field, x, 0, "replica warms up from 0 and decays to 0");
          } else if (q.key() == "warmup_type") {
            require_value(field, x, "linear", "replica's warm-up is linear");
          } else if (q.key() == "total_num_steps") {
            require_value(field, x, "auto", "the decay ends at the run's last step (max_steps or epochs)");
          } else {
            unsupported(field);
          }
        }
      } else {
        unsupported("scheduler." + it.key());
      }
    }
  }

  void offload(const std::string& section, const json& v, OffloadDevice RunParams::*device_key,
               const char* key_name) {
    object("zero_optimization." + section, v);
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string field = "zero_optimization." + section + "." + it.key();
      const json& x = it.value();
      if (it.key() == "device") {
        if (is_auto(x)) continue;
        const auto d = x.is_string() ? enum_from<OffloadDevice>(x.get<std::string>()) : std::nullopt;
        if (!d) fail("{}: field '{}' must be none, cpu or nvme, got {}", file_, field, json_excerpt(x));
        set(key_name, c_.params.*device_key, *d, field);
      } else if (it.key() == "nvme_path") {
        if (!x.is_string()) fail("{}: field '{}' must be a directory path, got {}", file_, field, json_excerpt(x));
        set("nvme_path", c_.params.nvme_path, x.get<std::string>(), field);
      } else if (it.key() == "pin_memory") {
        boolean(field, x);  // replica pins the host copies of offloaded CUDA state either way
      } else {
        unsupported(field);
      }
    }
  }

  void zero(const json& v) {
    object("zero_optimization", v);
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string field = "zero_optimization." + it.key();
      const json& x = it.value();
      const std::string& k = it.key();
      if (k == "stage") {
        const auto n = integer(field, x, 0, kMaxInt);
        if (!n) continue;
        if (*n > 3) fail("{}: field '{}' must be 0, 1, 2 or 3, got {}", file_, field, *n);
        set("zero_stage", c_.params.zero_stage, static_cast<int>(*n), field);
        if (*n == 3 && !loc_.has("params.distributed_backend")) c_.params.distributed_backend = DistributedBackend::Zero3;
      } else if (k == "offload_optimizer") {
        offload(k, x, &RunParams::offload_optimizer_device, "offload_optimizer_device");
      } else if (k == "offload_param") {
        offload(k, x, &RunParams::offload_param_device, "offload_param_device");
      } else if (k == "overlap_comm") {
        if (const auto b = boolean(field, x)) set("overlap_comm", c_.params.overlap_comm, *b, field);
      } else if (k == "reduce_bucket_size" || k == "stage3_prefetch_bucket_size" ||
                 k == "stage3_param_persistence_threshold" || k == "stage3_max_live_parameters" ||
                 k == "stage3_max_reuse_distance") {
        double RunParams::*member = k == "reduce_bucket_size"                   ? &RunParams::reduce_bucket_size
                                    : k == "stage3_prefetch_bucket_size"         ? &RunParams::stage3_prefetch_bucket_size
                                    : k == "stage3_param_persistence_threshold"  ? &RunParams::stage3_param_persistence_threshold
                                    : k == "stage3_max_live_parameters"          ? &RunParams::stage3_max_live_parameters
                                                                                 : &RunParams::stage3_max_reuse_distance;
        if (const auto d = number(field, x)) {
          if (*d < 0) fail("{}: field '{}' must be >= 0, got {}", file_, field, json_excerpt(x));
          set(k, c_.params.*member, *d, field);
        }
      } else if (k == "contiguous_gradients" || k == "allgather_partitions" || k == "reduce_scatter") {
        require_value(field, x, true, "replica's gradients and parameters live in flat buffers, reduced and "
                                      "gathered whole");
      } else if (k == "stage3_gather_16bit_weights_on_model_save") {
        require_value(field, x, true, "final/ always holds the gathered model");
      } else if (k == "sub_group_size") {
        number(field, x);  // Note [DeepSpeed config]: nothing to size in replica's step
      } else {
        unsupported(field);
      }
    }
  }

  struct Fp16Field {
    std::string field;
    json value;
    double wanted;
    std::string why;
  };

  RunConfig& c_;
  const KeyLocation& loc_;
  std::string file_;
  std::optional<bool> bf16_, fp16_;
  std::vector<Fp16Field> fp16_fields_;
};

}  // namespace

void apply_deepspeed_config(RunConfig& config, const KeyLocation& loc) {
  const std::string& file = config.params.deepspeed;
  if (file.empty()) return;
  std::string text;
  try {
    text = read_file(file, kMaxDeepSpeedJsonBytes);  // regular files only: never a FIFO's hang
  } catch (const Error& e) {
    fail("{}key 'params.deepspeed': {}", loc.where("params.deepspeed"), e.what());
  }
  // Nesting bounded (core/json.h): a value nested 10^6 deep is refused, not walked.
  Reader(config, loc, file).read(parse_json(text, file));
}

void apply_deepspeed_config(RunConfig& config) { apply_deepspeed_config(config, KeyLocation("", false)); }

}  // namespace replica::train
