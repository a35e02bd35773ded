#include "replica/cli/mds_command.h"

#include "replica/core/error.h"
#include "replica/data/mds.h"
#include "replica/data/synthetic_recsys.h"

#include <iostream>
#include <sstream>

namespace replica::cli {

struct MdsCommand {
  CLI::App* convert = nullptr;
  CLI::App* synthetic = nullptr;
  std::string input, out, columns, compression;
  int64_t size_limit = int64_t{1} << 26;
  data::SyntheticRecsysOptions recsys;
};

std::shared_ptr<MdsCommand> add_mds_command(CLI::App& mds) {
  auto c = std::make_shared<MdsCommand>();
  mds.require_subcommand(1);
  c->convert = mds.add_subcommand("convert", "Convert a JSONL or CSV file to MDS shards (Mosaic Streaming format v2)");
  c->convert->add_option("--input,input", c->input, "JSONL (one object per line) or CSV (header row) file")
      ->required()->check(CLI::ExistingFile);
  c->convert->add_option("--out,out", c->out, "Output directory (index.json + shard.NNNNN.mds)")->required();
  c->convert->add_option("--columns", c->columns,
                         "Columns and their MDS encodings: name:encoding,... (e.g. user_id:int64,title:str,"
                         "vec:ndarray:float32)")
      ->required();
  c->convert->add_option("--compression", c->compression, "none, zstd or zstd:LEVEL")->capture_default_str();
  c->convert->add_option("--size-limit,--size_limit", c->size_limit, "Bytes per shard before a new one starts")
      ->capture_default_str();

  c->synthetic = mds.add_subcommand("synthetic", "Write the synthetic recommender data set (planted user/item "
                                                 "clusters): OUT/train and OUT/valid as MDS, or OUT/train.jsonl "
                                                 "and OUT/valid.jsonl");
  auto& r = c->recsys;
  c->synthetic->add_option("--out,out", c->out, "Output directory")->required();
  c->synthetic->add_option("--users", r.users, "Users")->capture_default_str();
  c->synthetic->add_option("--items", r.items, "Items")->capture_default_str();
  c->synthetic->add_option("--clusters", r.clusters, "Planted taste clusters")->capture_default_str();
  c->synthetic->add_option("--train", r.train_samples, "Training interactions")->capture_default_str();
  c->synthetic->add_option("--valid", r.valid_samples, "Validation interactions")->capture_default_str();
  c->synthetic->add_option("--affinity", r.affinity, "Probability that an interaction is in the user's cluster")
      ->capture_default_str();
  c->synthetic->add_option("--seed", r.seed, "Random seed")->capture_default_str();
  c->synthetic->add_option("--compression", c->compression, "none, zstd or zstd:LEVEL (mds only)")
      ->capture_default_str();
  c->synthetic->add_option("--format", r.format, "mds (split directories) or jsonl (OUT/<split>.jsonl)")
      ->check(CLI::IsMember({"mds", "jsonl"}))
      ->capture_default_str();
  return c;
}

int run_mds_command(const MdsCommand& c) {
  data::MdsWriterOptions options;
  options.compression = c.compression == "none" ? "" : c.compression;
  if (*c.convert) {
    std::vector<data::MdsColumn> columns;
    std::stringstream in(c.columns);
    std::string item;
    while (std::getline(in, item, ',')) {
      // A piece without ':' continues the previous column's encoding: the shape of
      // `m:ndarray:int32:2,2` holds a comma.
      if (item.find(':') == std::string::npos && !columns.empty() && !item.empty()) {
        columns.back().encoding += "," + item;
        continue;
      }
      const auto colon = item.find(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == item.size()) {
        fail("--columns: '{}' is not name:encoding", item);
      }
      columns.push_back({item.substr(0, colon), item.substr(colon + 1)});
    }
    if (columns.empty()) fail("--columns: no columns given");
    options.size_limit = c.size_limit;
    const int64_t n = data::convert_records_to_mds(c.input, c.out, columns, options);
    std::cout << "wrote " << n << " samples to " << c.out << "\n";
    return 0;
  }
  data::SyntheticRecsysOptions r = c.recsys;
  r.compression = options.compression;
  data::write_synthetic_recsys(c.out, r);
  const std::string suffix = r.format == "jsonl" ? ".jsonl" : "";
  std::cout << "wrote " << r.train_samples << " training and " << r.valid_samples << " validation interactions to "
            << c.out << "/train" << suffix << " and " << c.out << "/valid" << suffix << "\n";
  return 0;
}

}  // namespace replica::cli
