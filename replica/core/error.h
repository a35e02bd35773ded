// replica::Error: the one exception type for user-facing failures.
//
// Why: every bad input must end in one clear line naming the thing at fault (file, key,
// tensor, rank) and a non-zero exit. Code throws replica::Error with that line; the CLI
// prints e.what() and exits 1. Anything else escaping is a bug and is reported as such.
//
// Thread-safety: an exception type and a formatting helper; no shared state.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace replica {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws replica::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace replica
