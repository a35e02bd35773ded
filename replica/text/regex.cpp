// Oniguruma patterns (what Hugging Face's Rust engine compiles) run on PCRE2.
//
// Both are backtracking, leftmost-first engines with the same syntax for everything the
// tokenizer.json files use; they differ in a few character classes, which are rewritten:
//   \s  Oniguruma: Unicode White_Space; PCRE2+UCP: that plus U+180E (MONGOLIAN VOWEL
//       SEPARATOR, white space before Unicode 6.3), so \s is spelled out
//   \w  Oniguruma: Letter | Mark | Number | Connector_Punctuation; PCRE2+UCP: L | N | _
//   \h  Oniguruma: a hex digit; PCRE2: horizontal space
// and the Unicode version differs: the Rust engine's regexes know Unicode 16.0, PCRE2 10.42
// (Debian 12) Unicode 14.0. A general category \p{X} also gets the characters of category X
// assigned since: Unicode 15.0 ones from ICU, Unicode 16.0 ones from the table below.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "replica/core/error.h"
#include "replica/text/tokenizer_impl.h"

#include <unicode/uchar.h>
#include <unicode/uniset.h>

#include <map>
#include <mutex>

namespace replica::text::detail {

namespace {

// Characters assigned in Unicode 16.0 by general category (letters, marks, digits,
// punctuation, symbols), which neither PCRE2 10.42 nor ICU 72 know.
struct NewerRanges {
  const char* category;
  std::vector<std::pair<char32_t, char32_t>> ranges;
};
const std::vector<NewerRanges>& unicode_16() {
  static const std::vector<NewerRanges> table = {
      {"Lu", {{0x1C89, 0x1C89}, {0xA7CB, 0xA7CC}, {0xA7DA, 0xA7DA}, {0xA7DC, 0xA7DC}, {0x10D50, 0x10D65}}},
      {"Ll", {{0x1C8A, 0x1C8A}, {0xA7CD, 0xA7CD}, {0xA7DB, 0xA7DB}, {0x10D70, 0x10D85}}},
      {"Lm", {{0x10D4E, 0x10D4E}, {0x10D6F, 0x10D6F}, {0x16D40, 0x16D42}, {0x16D6B, 0x16D6C}}},
      {"Lo", {{0x105C0, 0x105F3}, {0x10D4A, 0x10D4D}, {0x10D4F, 0x10D4F}, {0x10EC2, 0x10EC4},
              {0x11380, 0x11389}, {0x1138B, 0x1138B}, {0x1138E, 0x1138E}, {0x11390, 0x113B5},
              {0x113B7, 0x113B7}, {0x113D1, 0x113D1}, {0x113D3, 0x113D3}, {0x11BC0, 0x11BE0},
              {0x13460, 0x143FA}, {0x16100, 0x1611D}, {0x16D43, 0x16D6A}, {0x18CFF, 0x18CFF},
              {0x1E5D0, 0x1E5ED}, {0x1E5F0, 0x1E5F0}, {0x2EBF0, 0x2EE5D}}},
      {"Mn", {{0x897, 0x897}, {0x10D69, 0x10D6D}, {0x10EFC, 0x10EFC}, {0x113BB, 0x113C0},
              {0x113CE, 0x113CE}, {0x113D0, 0x113D0}, {0x113D2, 0x113D2}, {0x113E1, 0x113E2},
              {0x11F5A, 0x11F5A}, {0x1611E, 0x16129}, {0x1612D, 0x1612F}, {0x1E5EE, 0x1E5EF}}},
      {"Mc", {{0x113B8, 0x113BA}, {0x113C2, 0x113C2}, {0x113C5, 0x113C5}, {0x113C7, 0x113CA},
              {0x113CC, 0x113CD}, {0x113CF, 0x113CF}, {0x1612A, 0x1612C}}},
      {"Nd", {{0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9}, {0x16130, 0x16139},
              {0x16D70, 0x16D79}, {0x1CCF0, 0x1CCF9}, {0x1E5F1, 0x1E5FA}}},
      {"Pd", {{0x10D6E, 0x10D6E}}},
      {"Po", {{0x1B4E, 0x1B4F}, {0x1B7F, 0x1B7F}, {0x113D4, 0x113D5}, {0x113D7, 0x113D8},
              {0x11BE1, 0x11BE1}, {0x16D6D, 0x16D6F}, {0x1E5FF, 0x1E5FF}}},
      {"Sm", {{0x10D8E, 0x10D8F}}},
      {"So", {{0x2427, 0x2429}, {0x2FFC, 0x2FFF}, {0x31E4, 0x31E5}, {0x31EF, 0x31EF},
              {0x1CC00, 0x1CCEF}, {0x1CD00, 0x1CEB3}, {0x1F8B2, 0x1F8BB}, {0x1F8C0, 0x1F8C1},
              {0x1FA89, 0x1FA89}, {0x1FA8F, 0x1FA8F}, {0x1FABE, 0x1FABE}, {0x1FAC6, 0x1FAC6},
              {0x1FADC, 0x1FADC}, {0x1FADF, 0x1FADF}, {0x1FAE9, 0x1FAE9}, {0x1FBCB, 0x1FBEF}}},
  };
  return table;
}

bool is_general_category(const std::string& name) {
  static const char* kNames[] = {"L",  "Lu", "Ll", "Lt", "Lm", "Lo", "M",  "Mn", "Mc", "Me",
                                 "N",  "Nd", "Nl", "No", "P",  "Pc", "Pd", "Ps", "Pe", "Pi",
                                 "Pf", "Po", "S",  "Sm", "Sc", "Sk", "So", "Z",  "Zs", "Zl",
                                 "Zp", "C",  "Cc", "Cf", "Co"};
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  return false;
}

// Class items (\x{A}-\x{B}...) for the characters of general category `name` that PCRE2's
// Unicode 14.0 tables lack.
std::string newer_members(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::string> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = cache.find(name); it != cache.end()) return it->second;
  std::string out;
  auto item = [&](char32_t lo, char32_t hi) {
    out += fmt::format("\\x{{{:X}}}", static_cast<uint32_t>(lo));
    if (hi != lo) out += fmt::format("-\\x{{{:X}}}", static_cast<uint32_t>(hi));
  };
  UErrorCode status = U_ZERO_ERROR;
  icu::UnicodeSet set(icu::UnicodeString::fromUTF8("[[:gc=" + name + ":]-[:age=14.0:]]"), status);
  if (U_SUCCESS(status)) {
    for (int32_t r = 0; r < set.getRangeCount(); ++r) {
      item(static_cast<char32_t>(set.getRangeStart(r)), static_cast<char32_t>(set.getRangeEnd(r)));
    }
  }
  for (const auto& [category, ranges] : unicode_16()) {
    if (std::string(category).compare(0, name.size(), name) != 0) continue;
    for (const auto& [lo, hi] : ranges) item(lo, hi);
  }
  cache[name] = out;
  return out;
}

}  // namespace

std::string translate_onig_pattern(const std::string& p) {
  // Unicode White_Space.
  static const char* kSpace =
      "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
      "\\x{202F}\\x{205F}\\x{3000}";
  static const char* kWord = "\\p{L}\\p{M}\\p{N}\\p{Pc}";
  static const char* kHex = "0-9a-fA-F";
  std::string out;
  out.reserve(p.size() + 16);
  int class_depth = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      const bool in_class = class_depth > 0;
      auto cls = [&](const char* body, bool negate) {
        if (in_class) {
          if (negate) {  // a negated class inside a class has no PCRE2 spelling: keep it
            out += '\\';
            out += e;
          } else {
            out += body;
          }
        } else {
          out += negate ? "[^" : "[";
          out += body;
          out += ']';
        }
      };
      if ((e == 'p' || e == 'P') && i + 2 < p.size() && p[i + 2] == '{') {
        const size_t close = p.find('}', i + 3);
        if (close != std::string::npos) {
          std::string name = p.substr(i + 3, close - i - 3);
          bool negate = e == 'P';
          if (!name.empty() && name[0] == '^') {
            negate = !negate;
            name.erase(0, 1);
          }
          const std::string extra = is_general_category(name) ? newer_members(name) : "";
          const std::string prop = "\\p{" + name + "}";
          if (extra.empty() || (in_class && negate)) {
            out.append(p, i, close + 1 - i);  // as written
          } else if (in_class) {
            out += prop + extra;
          } else {
            out += (negate ? "[^" : "[") + prop + extra + "]";
          }
          i = close;
          continue;
        }
      }
      switch (e) {
        case 's': cls(kSpace, false); break;
        case 'S': cls(kSpace, true); break;
        case 'w': cls(kWord, false); break;
        case 'W': cls(kWord, true); break;
        case 'h': cls(kHex, false); break;
        case 'H': cls(kHex, true); break;
        default: {
          // Copy the escape verbatim (the escaped character may be multi-byte).
          const size_t n = cp_len(static_cast<unsigned char>(e));
          out.append(p, i, 1 + n);
          i += n - 1;
          break;
        }
      }
      ++i;
      continue;
    }
    if (c == '[') {
      // "[:alpha:]" inside a class is a POSIX class, not a nested set.
      if (class_depth > 0 && i + 1 < p.size() && p[i + 1] == ':') {
        const size_t end = p.find(":]", i + 2);
        if (end != std::string::npos) {
          out.append(p, i, end + 2 - i);
          i = end + 1;
          continue;
        }
      }
      ++class_depth;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') {
        out += '^';
        ++i;
      }
      if (i + 1 < p.size() && p[i + 1] == ']') {
        out += "\\]";
        ++i;
      }
      continue;
    }
    if (c == ']' && class_depth > 0) --class_depth;
    out += c;
  }
  return out;
}

std::string escape_regex(const std::string& literal) {
  std::string out;
  for (char c : literal) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u) && c != '_' && c != ' ') out += '\\';
    out += c;
  }
  return out;
}

Regex::Regex(const std::string& onig_pattern, const std::string& where)
    : where_(where + ": regex /" + text_excerpt(onig_pattern, 60) + "/") {
  const std::string pattern = translate_onig_pattern(onig_pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                             PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    fail("{} does not compile at offset {}: {}", where_, offset, reinterpret_cast<const char*>(message));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT fails
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

namespace {

// Per-thread JIT stack: greedy repeats over long runs (e.g. a 100 KB run of spaces) need
// more than PCRE2's default 32 KB.
struct MatchContext {
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchContext() {
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchContext() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
  }
};

}  // namespace

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  thread_local MatchContext mc;
  auto* code = static_cast<pcre2_code*>(code_);
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(code, nullptr), &pcre2_match_data_free);
  std::vector<std::pair<size_t, size_t>> out;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t last_end = 0;
  bool have_last = false;
  size_t last_match_end = 0;
  // Oniguruma's find_iter: an empty match right after the previous match is skipped.
  while (last_end <= s.size()) {
    const int rc = pcre2_match(code, subject, s.size(), last_end, PCRE2_NO_UTF_CHECK, md.get(),
                               mc.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      // PCRE2's match limit (10**7 backtracking steps per match) or its JIT stack ends a
      // pattern that backtracks catastrophically: the file and pattern are at fault.
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      fail("{} failed on a {}-byte piece of text: {} (the pattern backtracks too much to be usable)", where_,
           s.size(), reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    const size_t b = ov[0], e = ov[1];
    if (b == e && have_last && last_match_end == e) {
      if (last_end >= s.size()) break;
      last_end += cp_len(static_cast<unsigned char>(s[last_end]));
      continue;
    }
    last_end = e;
    last_match_end = e;
    have_last = true;
    out.emplace_back(b, e);
  }
  return out;
}

}  // namespace replica::text::detail
