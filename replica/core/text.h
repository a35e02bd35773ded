// Two facts about text from outside that every reader needs: whether it is UTF-8, and how to
// show a value of it in a message without repeating the whole of it.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace replica {

// At most `max_chars` bytes of `s` (cut at a UTF-8 character boundary), "..." after a cut: what
// a message shows of a value the input made up (a key, a path, a scalar), however long it is.
inline std::string excerpt(std::string_view s, std::size_t max_chars = 80) {
  if (s.size() <= max_chars) return std::string(s);
  std::size_t cut = max_chars;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a character
  return std::string(s.substr(0, cut)) + "...";
}

// The offset of the first byte of `s` that is not part of well-formed UTF-8 (overlong forms,
// surrogates and code points past U+10FFFF are not), or nullopt when all of it is.
inline std::optional<std::size_t> invalid_utf8_offset(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    for (std::size_t k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return i;
      const auto b = static_cast<unsigned char>(s[i + k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return i;
    }
    i += n + 1;
  }
  return std::nullopt;
}

}  // namespace replica
