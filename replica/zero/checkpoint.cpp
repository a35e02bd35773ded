#include "replica/zero/checkpoint.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/io/files.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <map>

namespace fs = std::filesystem;

namespace replica::zero {
namespace {

std::string rank_file(const std::string& dir, int rank) {
  return (fs::path(dir) / fmt::format("rank-{}.safetensors", rank)).string();
}

// The largest world a checkpoint is read back from; beyond any job replica runs.
constexpr int64_t kMaxWorldSize = int64_t{1} << 20;
// Element counts and offsets: exact in a double, far beyond any tensor.
constexpr int64_t kMaxNumel = int64_t{1} << 53;

// metadata.json, read as every outside JSON is (regular file, bounded size and nesting) and
// checked whole here, so that what reads it later (world_size, groups' numel/shard, params'
// shape/offset) narrows only values known to be in range.
nlohmann::json read_metadata(const std::string& dir) {
  const std::string path = (fs::path(dir) / "metadata.json").string();
  if (!fs::exists(path)) fail("{}: cannot open the ZeRO-3 checkpoint metadata", path);
  const nlohmann::json j = parse_json(read_file(path, std::uint64_t{256} << 20), path);
  auto integer = [&](const nlohmann::json& v, const std::string& what, int64_t min, int64_t max) {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(max)) ||
        v.get<int64_t>() < min || v.get<int64_t>() > max) {
      fail("{}: {} must be an integer from {} to {}, got {}", path, what, min, max, json_excerpt(v));
    }
    return v.get<int64_t>();
  };
  auto member = [&](const nlohmann::json& object, const char* key, const std::string& where) -> const nlohmann::json& {
    if (!object.is_object() || !object.contains(key)) fail("{}: {} has no '{}'", path, where, key);
    return object.at(key);
  };
  if (!j.is_object() || j.value("format", nlohmann::json()) != nlohmann::json("replica-zero3")) {
    fail("{}: format is not replica-zero3", path);
  }
  integer(member(j, "world_size", "the metadata"), "world_size", 1, kMaxWorldSize);
  const auto& groups = member(j, "groups", "the metadata");
  if (!groups.is_array()) fail("{}: groups must be a list, got {}", path, json_excerpt(groups));
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string where = fmt::format("groups[{}]", g);
    const auto& group = groups[g];
    if (!member(group, "name", where).is_string()) fail("{}: {}.name must be a string", path, where);
    if (group.contains("dtype") && !group["dtype"].is_string()) fail("{}: {}.dtype must be a string", path, where);
    const int64_t numel = integer(member(group, "numel", where), where + ".numel", 0, kMaxNumel);
    integer(member(group, "shard", where), where + ".shard", 0, kMaxNumel);
    const auto& params = member(group, "params", where);
    if (!params.is_array()) fail("{}: {}.params must be a list", path, where);
    for (size_t p = 0; p < params.size(); ++p) {
      const std::string at = fmt::format("{}.params[{}]", where, p);
      if (!member(params[p], "name", at).is_string()) fail("{}: {}.name must be a string", path, at);
      const auto& shape = member(params[p], "shape", at);
      if (!shape.is_array()) fail("{}: {}.shape must be a list, got {}", path, at, json_excerpt(shape));
      int64_t n = 1;
      for (const auto& d : shape) {
        if (__builtin_mul_overflow(n, integer(d, at + ".shape", 0, kMaxNumel), &n) || n > kMaxNumel) {
          fail("{}: {}.shape {} is too large", path, at, json_excerpt(shape));
        }
      }
      const int64_t offset = integer(member(params[p], "offset", at), at + ".offset", 0, kMaxNumel);
      if (offset + n > numel) fail("{}: {} (shape {}) lies outside its group", path, at, json_excerpt(shape));
    }
  }
  return j;
}

// "group.3.exp_avg" -> "group.3".
std::string group_of(const std::string& name) {
  const auto first = name.find('.');
  if (first == std::string::npos) return name;
  const auto second = name.find('.', first + 1);
  return second == std::string::npos ? name : name.substr(0, second);
}

struct SavedShards {
  nlohmann::json meta;
  std::vector<io::NamedTensors> ranks;  // every rank's file
  std::map<std::string, int64_t> shard_of, numel_of;
};

SavedShards read_all(const std::string& dir) {
  SavedShards s;
  s.meta = read_metadata(dir);
  const int world = s.meta["world_size"].get<int>();
  for (const auto& g : s.meta["groups"]) {
    s.shard_of[g.at("name").get<std::string>()] = g.at("shard").get<int64_t>();
    s.numel_of[g.at("name").get<std::string>()] = g.at("numel").get<int64_t>();
  }
  for (int r = 0; r < world; ++r) {
    const std::string path = rank_file(dir, r);
    if (!fs::exists(path)) fail("{}: missing (the checkpoint was written by {} workers)", path, world);
    s.ranks.push_back(io::load_safetensors(path).tensors);
    for (const auto& [name, t] : s.ranks.back()) {
      if (name.rfind("buffers.", 0) == 0) continue;
      if (!s.shard_of.count(group_of(name))) fail("{}: tensor '{}' belongs to no group of metadata.json", path, name);
    }
  }
  return s;
}

// The unpadded flat contents of `name` (a per-element shard tensor) joined over all ranks.
torch::Tensor joined(const SavedShards& s, const std::string& name, int64_t numel) {
  std::vector<torch::Tensor> parts;
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    auto it = std::find_if(s.ranks[r].begin(), s.ranks[r].end(), [&](const auto& p) { return p.first == name; });
    if (it == s.ranks[r].end()) fail("rank-{}.safetensors: tensor '{}' is missing", r, name);
    parts.push_back(it->second.reshape(-1));
  }
  torch::Tensor all = torch::cat(parts);
  if (all.numel() < numel) {
    fail("{}: the ranks' shards of '{}' hold {} elements, metadata.json says {}", "rank-*.safetensors", name,
         all.numel(), numel);
  }
  return all.narrow(0, 0, numel);
}

}  // namespace

void save_shards(const std::string& zero_dir, Zero3& engine, const io::NamedTensors& optimizer_state) {
  fs::create_directories(zero_dir);
  const int rank = engine.process_group().rank();
  io::NamedTensors tensors = engine.master_shards();
  for (const auto& t : optimizer_state) tensors.push_back(t);
  if (rank == 0) {
    for (auto& item : engine.module().named_buffers()) tensors.emplace_back("buffers." + item.key(), item.value().detach());
  }
  io::save_safetensors(rank_file(zero_dir, rank), tensors, {{"format", "replica-zero3"}});
  if (rank == 0) {
    nlohmann::json groups = nlohmann::json::array();
    for (const auto& g : engine.groups()) {
      nlohmann::json params = nlohmann::json::array();
      for (const auto& p : g.params) params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
      groups.push_back({{"name", g.name},
                        {"numel", g.numel},
                        {"shard", g.shard},
                        {"trainable", g.trainable},
                        {"dtype", c10::toString(g.dtype)},
                        {"params", params}});
    }
    nlohmann::json buffers = nlohmann::json::array();
    for (auto& item : engine.module().named_buffers()) buffers.push_back(item.key());
    nlohmann::json meta = {{"format", "replica-zero3"},
                           {"world_size", engine.process_group().size()},
                           {"groups", groups},
                           {"buffers", buffers}};
    write_file_atomically((fs::path(zero_dir) / "metadata.json").string(), meta.dump(2) + "\n");
  }
}

ShardSlice load_shards(const std::string& zero_dir, int rank, int world) {
  ShardSlice out;
  const SavedShards s = read_all(zero_dir);
  out.saved_world_size = s.meta["world_size"].get<int>();
  for (const auto& [name, t] : s.ranks[0]) {
    if (name.rfind("buffers.", 0) == 0) {
      out.buffers.emplace_back(name.substr(8), t);
      continue;
    }
    const std::string group = group_of(name);
    const int64_t old_shard = s.shard_of.at(group), numel = s.numel_of.at(group);
    torch::Tensor slice;
    // Per-element state is a 1-D float shard; AdamW's step is a 0-dim integer.
    if (t.dim() == 1 && t.is_floating_point() && t.numel() == old_shard) {
      const int64_t shard = (numel + world - 1) / world;
      torch::Tensor flat = torch::zeros({shard * world}, t.options());
      flat.narrow(0, 0, numel).copy_(joined(s, name, numel));
      slice = flat.narrow(0, rank * shard, shard).clone();
    } else {
      slice = t;  // a per-group scalar (AdamW's step): the same on every worker
    }
    (name == group ? out.masters : out.optimizer).emplace_back(name, slice);
  }
  return out;
}

io::NamedTensors consolidate(const std::string& zero_dir) {
  const SavedShards s = read_all(zero_dir);
  io::NamedTensors out;
  for (const auto& g : s.meta["groups"]) {
    const std::string name = g["name"].get<std::string>();
    const int64_t numel = g["numel"].get<int64_t>();
    torch::Tensor flat = joined(s, name, numel);
    torch::ScalarType dtype = torch::kFloat32;
    const std::string dtype_name = g.value("dtype", "Float");
    if (dtype_name == "BFloat16") dtype = torch::kBFloat16;
    if (dtype_name == "Half") dtype = torch::kFloat16;
    for (const auto& p : g["params"]) {
      const auto shape = p["shape"].get<std::vector<int64_t>>();
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      const int64_t offset = p["offset"].get<int64_t>();
      if (offset + n > numel) fail("{}/metadata.json: parameter '{}' lies outside its group", zero_dir, p["name"].get<std::string>());
      out.emplace_back(p["name"].get<std::string>(), flat.narrow(0, offset, n).reshape(shape).to(dtype).clone());
    }
  }
  for (const auto& [name, t] : s.ranks[0]) {
    if (name.rfind("buffers.", 0) == 0) out.emplace_back(name.substr(8), t);
  }
  return out;
}

std::string zero_dir_of(const std::string& checkpoint_dir) {
  fs::path dir(checkpoint_dir);
  if (!fs::exists(dir / "metadata.json") && fs::exists(dir / "zero" / "metadata.json")) dir /= "zero";
  if (!fs::exists(dir / "metadata.json")) {
    fail("{}: not a ZeRO-3 checkpoint (no zero/metadata.json); consolidate reads a checkpoint-STEP directory "
         "written with distributed_backend zero3",
         checkpoint_dir);
  }
  return dir.string();
}

}  // namespace replica::zero
