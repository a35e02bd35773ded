// `replica keys TASK --json`: a task's flags as data, for programs. The Python package's
// params classes (python/replica/_fields.py) are generated from it and checked against it by
// a test, so the two cannot drift.
#pragma once

#include "replica/train/run_config.h"

#include <string>

namespace replica::cli {

// {"task", "command", "run": [...], "keys": [...], "twins": [...], "autotrain_only": [...]}:
//  - run: the run's own flags the task takes (model, project_name, data_path, train_split,
//    valid_split, log, backend; for llm-sft also the column flags), each checked with
//    train::is_flag, with its default;
//  - keys: every params: key of the task, in the key table's order, with its flag, group,
//    help, kind, placeholder, switch/secret, other tools' names for it (known_as), and its
//    default with its real JSON type (null for a secret);
//  - twins: the params twins of data: keys (llm-sft: chat_template, text_column);
//  - autotrain_only: empty (AutoTrain's fields are all keys now; kept for readers of the format).
std::string keys_json(const std::string& task);

}  // namespace replica::cli
