#include "replica/train/checkpoint.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/io/files.h"
#include "replica/models/lora.h"
#include "replica/train/project_dir.h"
#include "replica/zero/checkpoint.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace replica::train {

nlohmann::json TrainerState::to_json() const {
  nlohmann::json j = {{"global_step", global_step}, {"epoch", epoch},       {"micro_step", micro_step},
                      {"world_size", world_size},   {"batch_size", batch_size},   {"seed", seed},
                      {"log_history", log_history}};
  if (loss_scale > 0) {
    j["loss_scale"] = loss_scale;
    j["loss_scale_good_steps"] = loss_scale_good_steps;
  }
  if (nonfinite_skipped_steps > 0) j["nonfinite_skipped_steps"] = nonfinite_skipped_steps;
  return j;
}

TrainerState TrainerState::from_json(const nlohmann::json& j, const std::string& where) {
  TrainerState s;
  try {
    s.global_step = j.at("global_step").get<int64_t>();
    s.epoch = j.at("epoch").get<int64_t>();
    s.micro_step = j.at("micro_step").get<int64_t>();
    s.world_size = j.at("world_size").get<int>();
    s.seed = j.at("seed").get<int64_t>();
    s.batch_size = j.value("batch_size", int64_t{0});
    if (j.contains("log_history")) s.log_history = j.at("log_history");
    s.loss_scale = j.value("loss_scale", 0.0);
    s.loss_scale_good_steps = j.value("loss_scale_good_steps", int64_t{0});
    s.nonfinite_skipped_steps = j.value("nonfinite_skipped_steps", int64_t{0});
  } catch (const std::exception& e) {
    fail("{}: not a replica trainer state: {}", where, e.what());
  }
  if (s.global_step < 0 || s.epoch < 0 || s.micro_step < 0 || s.world_size < 1 || s.nonfinite_skipped_steps < 0) {
    fail("{}: trainer state has negative counters", where);
  }
  return s;
}

std::string save_checkpoint(const std::string& project_dir, const Checkpoint& ckpt,
                            int save_total_limit) {
  const fs::path project(project_dir);
  const fs::path final_dir = project / fmt::format("checkpoint-{}", ckpt.state.global_step);
  const fs::path tmp = project / fmt::format(".checkpoint-{}.tmp-{}", ckpt.state.global_step, getpid());
  std::error_code ec;
  const auto previous = list_checkpoints(project_dir);  // newest first
  // The name held by something replica did not write (a symbolic link, a directory of the
  // user's): never replaced, and refused before anything is written.
  if (const fs::file_status held = fs::symlink_status(final_dir, ec);
      fs::exists(held) && !is_replica_checkpoint(final_dir)) {
    fail("cannot save {}: that name is taken by {} replica did not write; nothing was changed (move it away)",
         final_dir.string(), fs::is_symlink(held) ? "a symbolic link" : "an entry");
  }
  try {
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp);
    io::save_safetensors((tmp / ckpt.model_file).string(), ckpt.model, {{"format", "pt"}});
    if (ckpt.extras) ckpt.extras(tmp.string());
    io::save_safetensors((tmp / "optimizer.safetensors").string(), ckpt.optimizer);
    io::save_safetensors((tmp / "rng_state.safetensors").string(), ckpt.rng);
    // trainer_state.json last: its presence in a renamed directory marks a whole checkpoint.
    write_file_atomically((tmp / "trainer_state.json").string(), ckpt.state.to_json().dump(2) + "\n");
    // Checksums of everything above, verified before any resume from this checkpoint.
    io::write_checksum_manifest(tmp.string());
    fsync_path(tmp.string());
    // An older save of the same step (a resumed run redoing it) is moved aside rather than
    // deleted first, so some complete checkpoint-N exists at every instant. Only replica's
    // own: a symbolic link or a directory of the user's under that name is never replaced.
    const fs::path replaced = project / fmt::format(".checkpoint-{}.old-{}", ckpt.state.global_step, getpid());
    const bool had_same_step = is_replica_checkpoint(final_dir);
    if (had_same_step) fs::rename(final_dir, replaced);
    fs::rename(tmp, final_dir);
    fsync_path(project.string());
    if (had_same_step) fs::remove_all(replaced, ec);
  } catch (const std::exception& e) {
    fs::remove_all(tmp, ec);
    const std::string kept = previous.empty()
                                 ? "there is no earlier checkpoint to fall back on"
                                 : fmt::format("the previous checkpoint {} is intact and a restart resumes from it",
                                               previous.front());
    fail("could not save {}: {}; nothing was changed: {}", final_dir.string(), e.what(), kept);
  }

  if (save_total_limit > 0) {
    auto all = list_checkpoints(project_dir);  // newest first
    for (size_t i = static_cast<size_t>(save_total_limit); i < all.size(); ++i) {
      fs::remove_all(all[i], ec);
    }
  }
  return final_dir.string();
}

std::vector<std::string> list_checkpoints(const std::string& project_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(project_dir, ec)) return {};
  // Only directories replica wrote (project_dir.h): never a symbolic link such as
  // checkpoint-999 -> elsewhere, which would otherwise be "newest" and rotate the real ones away.
  for (const auto& entry : fs::directory_iterator(project_dir, ec)) {
    if (!is_replica_checkpoint(entry.path())) continue;
    found.emplace_back(checkpoint_step(entry.path().filename().string()), entry.path().string());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

Checkpoint load_checkpoint(const std::string& dir) {
  Checkpoint c;
  c.dir = dir;
  const fs::path d(dir);
  const fs::path state_path = d / "trainer_state.json";
  if (!fs::exists(state_path)) fail("{}: missing trainer_state.json", dir);
  // Before anything is parsed: a flipped byte anywhere must stop the resume from this one.
  if (!io::verify_checksum_manifest(dir)) {
    spdlog::warn("{} has no {} (saved by an older replica); its files cannot be verified", dir,
                 io::kChecksumManifest);
  }
  std::ifstream in(state_path);
  if (!in) fail("{}: cannot read trainer_state.json", dir);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    fail("{}: trainer_state.json is not valid JSON: {}", dir, e.what());
  }
  c.state = TrainerState::from_json(j, state_path.string());
  c.model_file = fs::exists(d / "adapter_model.safetensors") ? "adapter_model.safetensors" : "model.safetensors";
  c.model = io::load_safetensors((d / c.model_file).string()).tensors;
  c.optimizer = io::load_safetensors((d / "optimizer.safetensors").string()).tensors;
  if (fs::exists(d / "rng_state.safetensors")) {
    c.rng = io::load_safetensors((d / "rng_state.safetensors").string()).tensors;
  }
  return c;
}

std::optional<Checkpoint> latest_checkpoint(const std::string& project_dir,
                                            std::vector<std::string>* skipped) {
  for (const auto& dir : list_checkpoints(project_dir)) {
    try {
      return load_checkpoint(dir);
    } catch (const std::exception& e) {
      fmt::print(stderr, "warning: skipping checkpoint {}: {}\n", dir, e.what());
      if (skipped) skipped->push_back(dir);
    }
  }
  return std::nullopt;
}

std::vector<std::string> consolidate_checkpoint(const std::string& checkpoint_dir, const std::string& out_path) {
  const fs::path zero_dir = zero::zero_dir_of(checkpoint_dir);
  const fs::path dir = fs::path(checkpoint_dir) == zero_dir ? zero_dir.parent_path() : fs::path(checkpoint_dir);
  io::NamedTensors tensors = zero::consolidate(zero_dir.string());
  std::vector<std::string> written{out_path};
  const fs::path adapter_config = dir / "adapter_config.json";
  const bool lora = fs::exists(adapter_config);
  if (lora) {
    // A LoRA run: the base is frozen and unchanged; what it trained is the adapter.
    io::NamedTensors adapter;
    for (auto& [name, t] : tensors) {
      const std::string key = models::peft_adapter_key(name);
      if (!key.empty()) adapter.emplace_back(key, std::move(t));
    }
    if (adapter.empty()) fail("{}: adapter_config.json but no LoRA weights in {}", checkpoint_dir, zero_dir.string());
    tensors = std::move(adapter);
  }
  const fs::path out_dir = fs::absolute(out_path).parent_path();
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) fail("consolidate: cannot create the directory of OUT '{}': {}", out_dir.string(), ec.message());
  io::save_safetensors(out_path, tensors, {{"format", "pt"}});
  if (lora && !fs::exists(out_dir / "adapter_config.json")) {
    copy_file_atomically(adapter_config.string(), (out_dir / "adapter_config.json").string());
    written.push_back((out_dir / "adapter_config.json").string());
  }
  return written;
}

}  // namespace replica::train
