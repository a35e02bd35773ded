// Test support for the chat template tests: the fixtures of chat_templates/ (the real
// templates and expected.json, the renderings of render_reference.py with Python's Jinja2)
// and the comparison of replica's renderer with them. Shared by chat_template_test.cpp
// (the committed expectations) and chat_template_conformance_test.cpp (render_reference.py
// run live). Header-only.
#pragma once

#include <gtest/gtest.h>
#include "replica/testing/paths.h"
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "replica/testing/program_runner.h"
#include "replica/text/chat_template.h"

namespace replica::testing::chat_fixture {

using nlohmann::ordered_json;
using replica::text::ChatTemplate;
using replica::text::ChatTemplateError;

inline const std::filesystem::path kFixtures = std::filesystem::path(REPLICA_SOURCE_DIR) / "replica" / "text" / "tests" / "chat_templates";

// The fixtures' bytes ("" for a missing one: the comparison that follows fails on it).
using replica::testing::read_file;

inline void write_file(const std::filesystem::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

inline std::string fixture_template(const std::string& file) { return read_file(kFixtures / file); }

inline ChatTemplateError::Kind kind_of(const std::string& python_error_type) {
  using K = ChatTemplateError::Kind;
  static const std::map<std::string, K> kinds = {
      {"TemplateSyntaxError", K::Syntax},  {"TemplateAssertionError", K::Syntax},
      {"TemplateError", K::Raised},        {"UndefinedError", K::Undefined},
      {"SecurityError", K::Security},      {"TypeError", K::Type},
      {"ValueError", K::Type},             {"ZeroDivisionError", K::Type},
      {"OverflowError", K::Type},          {"TemplateRuntimeError", K::Runtime},
  };
  auto it = kinds.find(python_error_type);
  return it == kinds.end() ? K::Runtime : it->second;
}

// The message replica must give for the Python exception recorded in `expected`.
inline std::string expected_message(const ordered_json& expected) {
  if (expected.contains("error_message")) {
    return "chat template syntax error: " + expected["error_message"].get<std::string>() +
           " (line " + std::to_string(expected["error_lineno"].get<int>()) + ")";
  }
  return expected["error"].get<std::string>();
}

struct Outcome {
  bool ok = false;
  std::string text;  // output, or the error message
  ChatTemplateError::Kind kind = ChatTemplateError::Kind::Runtime;
};

template <typename Fn>
inline Outcome run(Fn&& fn) {
  Outcome o;
  try {
    o.text = fn();
    o.ok = true;
  } catch (const ChatTemplateError& e) {
    o.text = e.what();
    o.kind = e.kind();
  }
  return o;
}

// Compares one recorded expectation; returns whether it matched (and records a failure).
inline bool check(const std::string& label, const ordered_json& expected, const Outcome& got) {
  if (expected.contains("output")) {
    const std::string want = expected["output"].get<std::string>();
    if (!got.ok) {
      ADD_FAILURE() << label << ": expected output\n[" << want << "]\nbut got error: " << got.text;
      return false;
    }
    if (got.text != want) {
      ADD_FAILURE() << label << ":\n--- Jinja2 ---\n[" << want << "]\n--- replica ---\n[" << got.text << "]";
      return false;
    }
    return true;
  }
  const std::string want = expected_message(expected);
  const std::string type = expected["error_type"].get<std::string>();
  if (got.ok) {
    ADD_FAILURE() << label << ": expected " << type << " \"" << want << "\" but rendered\n[" << got.text << "]";
    return false;
  }
  if (got.text != want || got.kind != kind_of(type)) {
    ADD_FAILURE() << label << ": expected " << type << " \"" << want << "\" but got (kind "
                  << static_cast<int>(got.kind) << ") \"" << got.text << "\"";
    return false;
  }
  return true;
}

struct Counts {
  int chat = 0, chat_errors = 0, snippets = 0, mismatches = 0;
};

inline Counts check_fixture(const ordered_json& fx) {
  Counts n;
  std::map<std::string, ChatTemplate> templates;
  for (auto it = fx["templates"].begin(); it != fx["templates"].end(); ++it) {
    templates.emplace(it.key(), ChatTemplate(fixture_template(it.value()["file"].get<std::string>())));
  }
  for (const auto& c : fx["chat_cases"]) {
    const std::string tname = c["template"].get<std::string>();
    ordered_json extra = fx["templates"][tname]["special_tokens"];
    for (auto it = fx["extras"][c["extra"].get<std::string>()].begin();
         it != fx["extras"][c["extra"].get<std::string>()].end(); ++it) {
      extra[it.key()] = it.value();
    }
    const ordered_json& messages = fx["conversations"][c["conversation"].get<std::string>()];
    const bool agp = c["add_generation_prompt"].get<bool>();
    const ChatTemplate& tpl = templates.at(tname);
    Outcome got = run([&] { return tpl.render(messages, agp, extra); });
    if (!check(c["name"].get<std::string>(), c, got)) ++n.mismatches;
    ++n.chat;
    if (c.contains("error")) ++n.chat_errors;
  }
  int idx = 0;
  for (const auto& s : fx["snippets"]) {
    const std::string source = s["template"].get<std::string>();
    Outcome got = run([&] { return ChatTemplate(source).render_context(s["context"]); });
    if (!check("snippet #" + std::to_string(idx) + " " + source, s, got)) ++n.mismatches;
    ++n.snippets;
    ++idx;
  }
  return n;
}

inline ordered_json load_json(const std::filesystem::path& p) { return ordered_json::parse(read_file(p)); }

inline std::filesystem::path make_temp_dir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "replica_chat_XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
  return pattern;
}

}  // namespace replica::testing::chat_fixture
