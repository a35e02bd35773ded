// "Did you mean": the nearest name to a misspelt one (config keys, flags, tensor names).
#pragma once

#include <string>
#include <vector>

namespace replica {

// Closest candidate by edit distance (case-insensitive) when it is close enough to be a
// likely typo, else "".
std::string did_you_mean(const std::string& name, const std::vector<std::string>& candidates);

}  // namespace replica
