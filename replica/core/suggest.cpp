#include "replica/core/suggest.h"

#include <algorithm>
#include <cctype>
#include <limits>

namespace replica {
namespace {

int levenshtein(const std::string& a, const std::string& b) {
  std::vector<int> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    int diagonal = row[0];
    row[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      int above = row[j];
      int cost = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                         std::tolower(static_cast<unsigned char>(b[j - 1]))
                     ? 0
                     : 1;
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + cost});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string did_you_mean(const std::string& name, const std::vector<std::string>& candidates) {
  if (name.empty()) return "";
  const int limit = std::max<int>(2, static_cast<int>(name.size()) / 3);
  std::string best;
  int best_distance = std::numeric_limits<int>::max();
  for (const auto& candidate : candidates) {
    int distance = levenshtein(name, candidate);
    // Replacing every character is no typo, however short the words.
    if (distance >= static_cast<int>(std::max(name.size(), candidate.size()))) continue;
    if (distance <= limit && distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace replica
