#!/usr/bin/env python3
"""Reference renderings of chat templates and Jinja snippets by Python's Jinja2.

Sets Jinja2 up as transformers does (transformers/utils/chat_template_utils.py,
_compile_jinja_template): an ImmutableSandboxedEnvironment with trim_blocks=True,
lstrip_blocks=True, the loopcontrols extension and the {% generation %} tag, the globals
raise_exception and strftime_now, and transformers' tojson filter; then renders like
apply_chat_template: render(messages=..., tools=..., documents=...,
add_generation_prompt=..., **special_tokens, **kwargs).

Writes expected.json next to this script (or to --out PATH): every case with its output
(or error), which chat_template_test.cpp compares with replica's renderer byte for byte
(and chat_template_conformance_test.cpp runs this script live and compares again). Run it
with the project's virtual environment, whose PyPI Jinja2 is pinned in
scripts/requirements-test.txt:

    .venv/bin/python replica/text/tests/chat_templates/render_reference.py
"""

import argparse
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))


# --- the environment, as transformers builds it --------------------------------------------

class AssistantTracker(Extension):
    # transformers' {% generation %}...{% endgeneration %}: renders its body (the tracking of
    # assistant spans for return_assistant_tokens_mask is not part of the text)
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # We override the built-in tojson filter because Jinja's default filter escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def make_env():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENV = make_env()


def render(source, context):
    """{"output": str} or {"error": str(e), "error_type": class name[, "error_message", "error_lineno"]}."""
    try:
        return {"output": ENV.from_string(source).render(**context)}
    except jinja2.exceptions.TemplateSyntaxError as e:
        return {"error": str(e), "error_type": type(e).__name__, "error_message": e.message, "error_lineno": e.lineno}
    except Exception as e:  # noqa: BLE001 - every failure is a recorded expectation
        return {"error": str(e), "error_type": type(e).__name__}


# --- chat cases ----------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Température actuelle d'une ville (current temperature of a city).",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the documentation.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "default": 5},
                "threshold": {"type": "number", "default": 0.5},
                "exact": {"type": "boolean", "default": False},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query"],
        },
        "return": {"type": "array"},
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system_user": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "system_only": [SYSTEM],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the GPU cross the road? To reduce the latency."},
    ],
    "content_is_data": [
        {"role": "system", "content": "Answer {{ 7*7 }} literally; {% if true %}never{% endif %}."},
        {"role": "user", "content": "{{ 7*7 }} {% for x in [1,2] %}{{ x }}{% endfor %} {# c #} {%- raw %} {{ raise_exception('no') }}"},
        {"role": "assistant", "content": "Sure: {{ messages }} }} {{ %}"},
        {"role": "user", "content": "{% endfor %}{{"},
    ],
    "tricky_text": [
        {"role": "user", "content": "  quotes ' \" backslash \\ tab\t unicode é 中文 🤖 line\u2028sep \x7f ctrl\x01\n\n  "},
        {"role": "assistant", "content": "\n\nAnswer with trailing spaces   \n"},
        {"role": "user", "content": "<|im_end|> <s> [INST] <|eot_id|> fake tokens </s>"},
    ],
    "empty_content": [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "x"},
    ],
    "non_alternating": [
        {"role": "user", "content": "first"},
        {"role": "user", "content": "second"},
    ],
    "assistant_first": [
        {"role": "assistant", "content": "I start."},
        {"role": "user", "content": "OK."},
    ],
    "system_second": [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Hi."},
    ],
    "tool_roundtrip": [
        SYSTEM,
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}],
        },
        {"role": "tool", "content": "{\"temperature\": 22, \"sky\": \"clair\"}"},
        {"role": "assistant", "content": "It is 22 °C and clear in Paris."},
    ],
    "tool_ids": [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                {"id": "call00002", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call00001", "content": "-3"},
        {"role": "tool", "tool_call_id": "call00002", "content": "18"},
        {"role": "assistant", "content": "Oslo -3, Rome 18."},
    ],
    "multi_step_tool": [
        {"role": "user", "content": "Find docs about DDP, then summarize."},
        {
            "role": "assistant",
            "content": "Let me search.",
            "tool_calls": [
                {"type": "function", "function": {"name": "search_docs", "arguments": {"query": "DDP", "limit": 2}}},
                {"type": "function", "function": {"name": "search_docs", "arguments": "{\"query\": \"allreduce\"}"}},
            ],
        },
        {"role": "tool", "content": "<doc>DDP syncs gradients</doc>"},
        {"role": "tool", "content": "<doc>allreduce sums</doc>"},
        {"role": "assistant", "content": "DDP averages gradients with allreduce."},
        {"role": "user", "content": "<tool_response>fake</tool_response>"},
    ],
    "reasoning": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning_content": "\nSimple arithmetic.\n", "content": "\n\nThe answer is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd three and three.\n</think>\n\n6."},
    ],
    "reasoning_inline_last": [
        {"role": "user", "content": "Think, then answer: 5*5?"},
        {"role": "assistant", "content": "<think>five fives</think>25"},
    ],
    "tool_content_null": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]},
    ],
    "builtin_tool_call": [
        {"role": "user", "content": "Search the web for LibTorch."},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "brave_search", "arguments": {"query": "LibTorch C++"}}}]},
        {"role": "ipython", "content": {"results": ["pytorch.org"]}},
    ],
    "multimodal_content": [
        {"role": "system", "content": [{"type": "text", "text": "Describe images."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}]},
        {"role": "assistant", "content": "A cat."},
    ],
    "numbers_in_content": [
        {"role": "user", "content": "Numbers"},
        {"role": "assistant", "content": "1.0 == 1"},
        {"role": "user", "content": "ok"},
    ],
}

EXTRAS = {
    "none": {},
    "tools": {"tools": TOOLS},
    "tools_in_system": {"tools": TOOLS, "tools_in_user_message": False},
    "date": {"date_string": "01 Jan 2025"},
    "builtin_tools": {"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"], "tools": [WEATHER_TOOL]},
    "thinking_off": {"enable_thinking": False},
    "thinking_on": {"enable_thinking": True},
    "fixed_date": {"date_string": "26 Jul 2024"},
    "fixed_date_tools": {"date_string": "26 Jul 2024", "tools": TOOLS},
}

ALL_CONV = list(CONVERSATIONS)
PLAIN_CONV = ["user", "system_user", "system_only", "multi_turn", "multi_turn_no_system", "content_is_data",
              "tricky_text", "empty_content", "non_alternating", "assistant_first", "system_second", "numbers_in_content"]

LLAMA3_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
LLAMA2_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
QWEN_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

TEMPLATES = {
    # name: (file, special tokens, conversations, extras)
    "llama3": ("llama3.jinja", LLAMA3_TOKENS, PLAIN_CONV, ["none"]),
    "llama3_instruct": ("llama3_instruct.jinja", LLAMA3_TOKENS, PLAIN_CONV, ["none"]),
    "llama3_1": ("llama3_1.jinja", LLAMA3_TOKENS, ALL_CONV, ["none", "tools", "tools_in_system", "date", "builtin_tools"]),
    "llama3_2": ("llama3_2.jinja", LLAMA3_TOKENS, ALL_CONV, ["fixed_date", "fixed_date_tools"]),
    "llama2_chat": ("llama2_chat.jinja", LLAMA2_TOKENS, PLAIN_CONV, ["none"]),
    "qwen3": ("qwen3.jinja", QWEN_TOKENS, ALL_CONV, ["none", "tools", "thinking_off", "thinking_on"]),
    "qwen2_5": ("qwen2_5.jinja", QWEN_TOKENS, ALL_CONV, ["none", "tools"]),
    "mixtral_instruct_v01": ("mixtral_instruct_v01.jinja", LLAMA2_TOKENS, PLAIN_CONV, ["none"]),
    "mistral_instruct_v03": ("mistral_instruct_v03.jinja", LLAMA2_TOKENS, ALL_CONV, ["none", "tools"]),
    "mistral_instruct_v03_early": ("mistral_instruct_v03_early.jinja", LLAMA2_TOKENS, PLAIN_CONV + ["tool_ids"], ["none", "tools"]),
    "chatml": ("chatml.jinja", {"eos_token": "<|im_end|>"}, PLAIN_CONV, ["none"]),
    "zephyr": ("zephyr.jinja", {"eos_token": "</s>"}, PLAIN_CONV, ["none"]),
    "gemma3": ("gemma3.jinja", {"bos_token": "<bos>", "eos_token": "<eos>"}, PLAIN_CONV + ["multimodal_content"], ["none"]),
    "qwen3_coder_abridged": ("qwen3_coder_abridged.jinja", QWEN_TOKENS, ALL_CONV, ["none", "tools"]),
}


# Extras that only change the preamble (tools, dates) are rendered with these conversations.
PREAMBLE_CONV = {"user", "system_user", "system_only", "multi_turn", "tricky_text", "tool_roundtrip", "tool_ids",
                 "multi_step_tool", "reasoning", "tool_content_null", "builtin_tool_call"}
PREAMBLE_EXTRAS = {"tools", "tools_in_system", "date", "builtin_tools", "fixed_date_tools"}


def chat_cases():
    cases = []
    for tname, (file, tokens, convs, extras) in TEMPLATES.items():
        with open(os.path.join(HERE, file), encoding="utf-8") as f:
            source = f.read()
        for conv in convs:
            for extra in extras:
                if extra in PREAMBLE_EXTRAS and conv not in PREAMBLE_CONV:
                    continue
                for agp in (False, True):
                    kwargs = dict(tokens)
                    kwargs.update(EXTRAS[extra])
                    tools = kwargs.pop("tools", None)
                    documents = kwargs.pop("documents", None)
                    context = dict(messages=CONVERSATIONS[conv], tools=tools, documents=documents,
                                   add_generation_prompt=agp, **kwargs)
                    case = {"name": f"{tname}/{conv}/{extra}/{'gen' if agp else 'nogen'}", "template": tname,
                            "conversation": conv, "extra": extra, "add_generation_prompt": agp}
                    case.update(render(source, context))
                    cases.append(case)
    return cases


# --- Jinja semantics snippets --------------------------------------------------------------

# (template, context): Python semantics of the interpreter, one construct at a time.
SNIPPETS = [
    # whitespace control, trim_blocks, lstrip_blocks
    ("  {% if true %}\n  x\n  {% endif %}\n  y", {}),
    ("a {% if true %}b{% endif %} c", {}),
    ("a\n  {# c #}\n  b", {}),
    ("a\n  {{ 1 }}\n  b", {}),
    ("{%- if true -%}\n  x  \n{%- endif -%}  \n z", {}),
    ("a  {%- if true %}b{% endif -%}  \n\n c", {}),
    ("a  {%+ if true %}b{% endif +%}\nc", {}),
    ("x\n  {%+ if true %}y\n  {% endif %}\nz", {}),
    ("{% for i in [1,2] %}\n  {{ i }}\n{% endfor %}\n", {}),
    ("{% for i in [1,2] -%}\n  {{ i }}\n{%- endfor %}", {}),
    ("{{- '  a  ' -}}  \n  {{ 'b' }}\t\n", {}),
    ("a\n\t {# comment -#}   \n b", {}),
    ("a {#- c #}\nb {#+ c +#}\nc", {}),
    ("{# multi\nline\ncomment #}\nafter", {}),
    ("{% raw %}\n{{ x }}{% endraw %}\nz", {}),
    ("{%- raw -%}  {% if %}  {%- endraw -%}  !", {}),
    ("line1\n    {% set x = 1 %}\n    {{ x }}\n", {}),
    ("x\n\n", {}),
    ("x\r\ny\rz\n", {}),
    ("\n", {}),
    ("", {}),
    ("{{ '{{' }} {{ '}}' }} {{ '{%' }}", {}),
    ("{ {x} } %} #} }}", {}),
    ("{{ {'a': {'b': 1}} }}", {}),
    ("{{ {'a': {'b': 1}}['a']['b'] }}", {}),
    ("{% if true %}{% if true %}\n  inner\n{% endif %}{% endif %}", {}),
    ("    {%- set x = 5 %}\n    {{- x }}", {}),
    # literals and escapes
    ("{{ 'a\\nb\\x41\\u00e9\\U0001F600\\q\\101\\'' }}", {}),
    ("{{ \"it's\" }}{{ 'say \"hi\"' }}{{ 'it''s' }}{{ 'a' \"b\" }}", {}),
    ("{{ 42 }} {{ 1_000 }} {{ 0x1F }} {{ 0o17 }} {{ 0b101 }} {{ 3.5 }} {{ 1e3 }} {{ 2.5E-3 }} {{ 1_0.0_1 }}", {}),
    ("{{ true }} {{ True }} {{ false }} {{ none }} {{ None }}", {}),
    ("{{ [1, 'a', none, true, 1.5, {'k': 'v'}, [2]] }}", {}),
    ("{{ (1,) }}{{ (1, 2) }}{{ () }}{{ [] }}{{ {} }}", {}),
    ("{{ {'a': 1, 'b': [1, 2], 3: 'c', none: 'n'} }}", {}),
    ("{{ ['it\\'s', \"q\\\"q\", 'back\\\\slash', 'nl\\n', 'é', '\\x00'] }}", {}),
    ("{{ 1, 2 }}", {}),
    # numbers and floats as Python prints them
    ("{{ 1.0 }} {{ 1e16 }} {{ 1e15 }} {{ 0.1 + 0.2 }} {{ 1 / 3 }} {{ 2 ** -1 }} {{ 10 / 2 }}", {}),
    ("{{ 9999999999999999.0 }} {{ 0.1 }} {{ 1e-7 }} {{ 0.0001 }} {{ 0.00001 }} {{ 123456789012345678 }}", {}),
    ("{{ 1.5e300 * 1e10 }} {{ -1.5e300 * 1e10 }} {{ -0.0 }} {{ 3.14159265358979 }} {{ 100.0 }} {{ 1.5e-10 }}", {}),
    ("{{ x }} {{ y }} {{ z }}", {"x": 2.5, "y": 100, "z": 1e22}),
    # arithmetic
    ("{{ 'x' * 3 }}{{ [1] * 2 }}{{ 3 * 'ab' }}{{ 7 / 2 }}{{ 2 ** 10 }}{{ 2 ** 0.5 }}{{ -7 // 2 }}{{ 7.5 % 2 }}", {}),
    ("{{ 5 // 2 }} {{ -5 // 2 }} {{ -5 % 3 }} {{ 5.0 // 2 }} {{ 7 % -3 }} {{ -7.5 // 2 }} {{ -7.5 % 2 }}", {}),
    ("{{ 1 + 2 * 3 - 4 / 2 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 10 - 2 - 3 }}", {}),
    ("{{ true + 1 }} {{ true * 3 }} {{ 1 + 1.5 }} {{ [1] + [2] }} {{ (1,) + (2,) }} {{ 'a' + 'b' }}", {}),
    ("{{ 'a' ~ 1 ~ none ~ 1.5 ~ x ~ [1] ~ true }}", {}),
    ("{{ -x }} {{ +x }} {{ -(1.5) }} {{ - true }}", {"x": 3}),
    ("{{ '%s-%d' % ('a', 3) }}|{{ '%05.2f' % 3.14159 }}|{{ 'x%sy' % 'z' }}|{{ '%r' % 'q' }}|{{ '%(a)s' % {'a': 1} }}|{{ '%x %o %e %%' % (255, 8, 12345.678) }}", {}),
    ("{{ 'a' + 1 }}", {}),
    ("{{ 1 + 'a' }}", {}),
    ("{{ ['a'] + ('b',) }}", {}),
    ("{{ 1 / 0 }}", {}),
    ("{{ 1 // 0 }}", {}),
    ("{{ 'a' - 'b' }}", {}),
    ("{{ -'a' }}", {}),
    ("{{ x + 1 }}", {}),
    ("{{ '%d' % 'x' }}", {}),
    # comparisons, logic, truthiness
    ("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ not 1 == 2 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ none == none }}", {}),
    ("{{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 != 'a' }} {{ 'B' < 'a' }} {{ (1, 2) == (1, 2) }} {{ [1] == (1,) }}", {}),
    ("{{ {'a': 1, 'b': 2} == {'b': 2, 'a': 1} }} {{ 2 in [1, 2] }} {{ 'b' in 'abc' }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}", {}),
    ("{{ 1 and 2 }} {{ 0 or 'x' }} {{ none or [] }} {{ 0 and x }} {{ '' or 'e' }} {{ not [] }} {{ not {} }} {{ not 0.0 }}", {}),
    ("{% if [] %}a{% elif {} %}b{% elif '' %}c{% elif 0 %}d{% elif none %}e{% elif x %}f{% else %}g{% endif %}", {}),
    ("{% if [0] %}a{% endif %}{% if ' ' %}b{% endif %}{% if 0.1 %}c{% endif %}{% if {'a':0} %}d{% endif %}", {}),
    ("{{ 'a' < 1 }}", {}),
    ("{{ x < 1 }}", {}),
    ("{{ x == y }} {{ x != 1 }} {{ 'x' in x }} {{ x in [1] }}", {}),
    ("{{ 'x' in none }}", {}),
    ("{{ 1 in 'abc' }}", {}),
    # inline if
    ("{{ 'a' if x else 'b' }}{{ 'c' if 1 }}{{ 'd' if 0 }}|{{ (1 if false) is defined }}", {}),
    ("{{ 1 if true else 2 if true else 3 }} {{ 1 if false else 2 if false else 3 }}", {}),
    # undefined
    ("[{{ x }}][{{ x.y if x is defined }}][{{ none.foo }}][{{ {}.foo }}][{{ [1][5] }}][{{ 'abc'[9] }}]", {}),
    ("{{ x.foo }}", {}),
    ("{{ x.foo.bar }}", {}),
    ("{{ {}.foo.bar }}", {}),
    ("{{ {}['a']['b'] }}", {}),
    ("{{ [1][5] + 1 }}", {}),
    ("{{ none.x + 1 }}", {}),
    ("{{ 'abc'.foo + 1 }}", {}),
    ("{{ x.y.z }}", {"x": {"y": None}}),
    ("{{ x.y() }}", {"x": {}}),
    ("{{ undefined_fn() }}", {}),
    ("{{ 'a'() }}", {}),
    ("{{ x | length }} {{ x | string }} {{ x | list }} {{ x | default('d') }} {{ x is iterable }} {{ x is sequence }}", {}),
    ("{% for a in x %}{{ a }}{% else %}empty{% endfor %}", {}),
    ("{{ x | tojson }}", {}),
    ("{{ x ~ 'a' }} {{ x is none }} {{ x is string }} {{ x is not defined }}", {}),
    # attribute and item access
    ("{{ d.a }} {{ d['a'] }} {{ d.get('a') }} {{ d.get('z', 9) }} {{ d.get('z') }} {{ d.items is callable }}", {"d": {"a": 1}}),
    ("{{ d['items'] is callable }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.items() | list }}", {"d": {"b": 1, "a": 2}}),
    ("{{ d.items is callable }}", {"d": {"items": 1}}),
    ("{{ d['items'] }}", {"d": {"items": 1}}),
    ("{{ l.0 }} {{ l[-1] }} {{ l[1:] }} {{ l[:-1] }} {{ l[::-1] }} {{ l[::2] }} {{ l[5:] }} {{ l[-10:2] }}", {"l": [1, 2, 3, 4]}),
    ("{{ 'hello'[1:3] }} {{ 'hello'[-1] }} {{ 'héllo'[1] }} {{ 'héllo'[::-1] }} {{ 'abc'[5] }}|", {}),
    ("{{ (1, 2)[0] }} {{ (1, 2, 3)[1:] }} {{ l[1:3:1] }} {{ l[3:0:-1] }} {{ l[::-2] }}", {"l": [0, 1, 2, 3, 4]}),
    ("{{ l[x:] }}", {"l": [1, 2]}),
    ("{{ d[1:] }}", {"d": {"a": 1}}),
    ("{{ n[1:] }}", {"n": 5}),
    ("{{ x[1:] }}", {}),
    ("{{ l['a':] }}", {"l": [1, 2]}),
    ("{{ l['a'] }}|{{ l[1.5] }}|{{ d[1] }}|{{ d[none] }}", {"l": [1], "d": {"1": "s"}}),
    ("{{ d._hidden }} {{ d['_hidden'] }} {{ d.__class__ }}|", {"d": {"_hidden": 1}}),
    ("{{ l.append }}|{{ d.update }}|{{ d.pop }}|", {"l": [1], "d": {}}),
    ("{{ l.append(3) }}", {"l": [1]}),
    ("{{ d.update({'a': 1}) }}", {"d": {}}),
    ("{{ l.count(1) }} {{ l.index(2) }} {{ (1, 2).index(2) }} {{ l.copy() }}", {"l": [1, 2, 1]}),
    # string methods
    ("{{ 'a,b,,c'.split(',') }}{{ ' a  b '.split() }}{{ 'a b c'.split(' ', 1) }}{{ 'abc'.rsplit('b') }}{{ 'a b c'.rsplit(None, 1) }}{{ '  x  y '.split(None, 1) }}", {}),
    ("{{ '  x '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\\n\\nx\\n'.lstrip('\\n') }}|{{ '\\n\\nx\\n'.rstrip('\\n') }}|{{ ' \\u3000x\\xa0'.strip() }}|", {}),
    ("{{ 'Hello World'.title() }}|{{ 'hello wORLD'|title }}|{{ \"they're bill's\".title() }}|{{ 'hELLO'|capitalize }}|{{ 'hELLO'.capitalize() }}", {}),
    ("{{ 'AbC'.lower() }}{{ 'x'.upper() }}{{ 'ÉCOLE'.lower() }}{{ 'straße'.upper() }}{{ 'aBc'.swapcase() }}", {}),
    ("{{ 'ab'.startswith(('x', 'a')) }}{{ 'abc'.endswith('bc') }}{{ 'abc'.startswith('b', 1) }}{{ 'abc'.endswith('b', 0, 2) }}", {}),
    ("{{ 'abc'.replace('b', '') }}{{ 'aaa'.replace('a', 'b', 2) }}{{ 'ab'.replace('', '-') }}{{ 'abc'.find('c') }}{{ 'abc'.find('z') }}{{ 'héllo'.find('l') }}{{ 'abcabc'.rfind('b') }}", {}),
    ("{{ 'a-b'.join(['x', 'y']) }}{{ ', '.join('abc') }}{{ 'abab'.count('ab') }}{{ 'aaa'.count('') }}", {}),
    ("{{ 'abc'.isalpha() }}{{ '123'.isdigit() }}{{ 'a1'.isalnum() }}{{ ' \\t'.isspace() }}{{ 'abc'.islower() }}{{ 'ABC'.isupper() }}{{ ''.isdigit() }}{{ 'a1'.islower() }}", {}),
    ("{{ 'a\\nb\\r\\nc'.splitlines() }}{{ 'a\\nb\\n'.splitlines(true) }}{{ '5'.zfill(3) }}{{ '-5'.zfill(3) }}{{ 'ab'.center(6, '*') }}{{ 'ab'.ljust(4, '.') }}{{ 'ab'.rjust(4) }}", {}),
    ("{{ 'pre_x'.removeprefix('pre_') }}{{ 'x.txt'.removesuffix('.txt') }}{{ 'a=b=c'.partition('=') }}{{ 'a=b=c'.rpartition('=') }}{{ 'abc'.partition('z') }}", {}),
    ("{{ '{} {}'.format(1, 'a') }}|{{ '{0}{name}{0}'.format(1, name='n') }}|{{ '{:>5}|{:<4}|{:^5}|{:05d}|{:.2f}|{:,}'.format('r', 'l', 'c', 42, 3.14159, 1234567) }}|{{ '{{}}{!r}'.format('q') }}", {}),
    ("{{ 'x'.encode is callable }}|{{ 'x'.nosuch is defined }}", {}),
    ("{{ 'abc'.join(1) }}", {}),
    ("{{ ''.join([1, 2]) }}", {}),
    ("{{ 'a'.split('') }}", {}),
    # filters
    ("{{ '  a b  ' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ 5 | trim }}|{{ none | trim }}", {}),
    ("{{ 'AbC' | lower }}{{ 'AbC' | upper }}{{ 1.5 | string }}{{ none | string }}{{ [1, 'a'] | string }}", {}),
    ("{{ x | length }}{{ 'héllo' | length }}{{ {'a': 1} | length }}{{ [1, 2] | count }}{{ (1, 2, 3) | length }}", {}),
    ("{{ 1 | length }}", {}),
    ("{{ none | length }}", {}),
    ("{{ [3, 1, 2] | sort }}{{ ['b', 'A', 'c'] | sort }}{{ ['b', 'A', 'c'] | sort(case_sensitive=true) }}{{ [3, 1, 2] | sort(reverse=true) }}", {}),
    ("{{ [{'a': 2, 'b': 'x'}, {'a': 1, 'b': 'y'}] | sort(attribute='a') }}{{ [{'n': {'v': 2}}, {'n': {'v': 1}}] | sort(attribute='n.v') | map(attribute='n.v') | list }}", {}),
    ("{{ {'b': 1, 'a': 2} | dictsort }}{{ {'b': 1, 'a': 2} | dictsort(by='value') }}{{ {'b': 1, 'A': 2} | dictsort(reverse=true) }}", {}),
    ("{{ [1, 2, 3] | sum }}{{ [1, 2] | max }}{{ [1, 2] | min }}{{ [] | max }}|{{ ['a', 'B'] | max }}{{ [{'v': 1}, {'v': 3}] | max(attribute='v') }}{{ [1.5, 2] | sum(start=10) }}", {}),
    ("{{ ['a', 'b'] | join(', ') }}{{ [1, none] | join }}{{ 'abc' | join('-') }}{{ [{'n': 'x'}, {'n': 'y'}] | join('+', attribute='n') }}", {}),
    ("{{ 'abc' | first }}{{ [] | first }}|{{ 'abc' | last }}{{ [1, 2] | last }}{{ 'abc' | reverse }}{{ [1, 2] | reverse | list }}{{ {'a': 1, 'b': 2} | first }}{{ {'a': 1, 'b': 2} | last }}", {}),
    ("{{ 3.7 | int }}{{ '42.5' | int }}{{ 'x' | int }}{{ '0x1A' | int(0, 16) }}{{ '12' | float }}{{ 'x' | float(1.5) }}{{ ' 7 ' | int }}{{ true | int }}{{ '1_000' | int }}", {}),
    ("{{ 2.5 | round }}{{ 3.5 | round }}{{ 2.675 | round(2) }}{{ 5 | round }}{{ 2.1 | round(0, 'ceil') }}{{ 2.9 | round(method='floor') }}{{ -2.5 | round }}{{ 1234.5678 | round(-2) }}", {}),
    ("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent(2, blank=true) }}|{{ 'a\\nb' | indent('> ') }}|{{ 'x' | indent }}", {}),
    ("{{ {'a': 1} | items | list }}{{ x | items | list }}{% for k, v in {'z': 1, 'y': 2} | items %}{{ k }}={{ v }};{% endfor %}", {}),
    ("{{ 1 | items | list }}", {}),
    ("{{ [1, 2, 3] | select('odd') | list }}{{ [1, 2, 3] | reject('odd') | list }}{{ [0, 1, '', 'a'] | select | list }}{{ [1, 2, 3, 4] | select('divisibleby', 2) | list }}{{ [1, 5, 9] | select('gt', 4) | list }}", {}),
    ("{{ [{'r': 'u'}, {'r': 'a'}] | selectattr('r', 'equalto', 'u') | list }}{{ [{'r': 1}, {}] | selectattr('r') | list }}{{ [{'r': 1}, {}] | rejectattr('r') | list }}{{ [{'r': 'a'}, {'r': 'b'}] | rejectattr('r', 'in', ['a']) | list }}", {}),
    ("{{ [{'n': 'a'}, {'n': 'b'}] | map(attribute='n') | join('-') }}{{ ['a', 'b'] | map('upper') | list }}{{ [1, 2] | map('string') | list }}{{ [{'n': 1}, {}] | map(attribute='n', default=0) | list }}{{ ['a b', 'c'] | map('replace', ' ', '_') | list }}", {}),
    ("{{ ['a', 'A', 'b', 'a'] | unique | list }}{{ ['a', 'A'] | unique(case_sensitive=true) | list }}{{ [{'k': 1}, {'k': 1}, {'k': 2}] | unique(attribute='k') | list }}", {}),
    ("{{ 'a <b> & \"c\"' | escape }}{{ 'x' | e }}{{ '<p>' | safe }}{{ 'hello world foo' | wordcount }}{{ 'abc' | center(7) }}|", {}),
    ("{{ x | default('dflt') }}{{ none | default('dflt') }}{{ '' | default('dflt', true) }}{{ 0 | d('z', boolean=true) }}{{ false | default('f') }}", {}),
    ("{{ 'hello world' | replace('o', '0') }}{{ 'aaa' | replace('a', 'b', 1) }}{{ 12321 | replace('2', 'x') }}", {}),
    ("{{ [1, 2, 3, 4, 5] | batch(2) | list }}{{ [1, 2, 3] | batch(2, 'x') | list }}", {}),
    ("{{ '%s and %s' | format('a', 'b') }}{{ '%(x)s!' | format(x=1) }}", {}),
    ("{{ 'some long text here' | truncate(9) }}|{{ 'some long text here' | truncate(9, true) }}|{{ 'short' | truncate(9) }}", {}),
    ("{{ -3 | abs }}{{ -2.5 | abs }}{{ {'a': 1} | attr('a') }}|{{ 'x' | attr('upper') is callable }}|{{ {'a': 1} | attr('items') is callable }}|", {}),
    ("{{ 'abc' | list }}{{ {'a': 1, 'b': 2} | list }}{{ none | list }}", {}),
    ("{{ 'x' | nosuchfilter }}", {}),
    # tojson (transformers' json.dumps)
    ("{{ 'é' | tojson }}{{ 'é' | tojson(ensure_ascii=true) }}{{ {'a': 1} | tojson(indent=2) }}{{ [1, [2]] | tojson(separators=(',', ':')) }}{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}", {}),
    ("{{ 1.0 | tojson }}{{ none | tojson }}{{ true | tojson }}{{ 'a\\u007fb\\u2028\\x01\\n\\t\"\\\\/' | tojson }}{{ '🤖' | tojson(ensure_ascii=true) }}{{ 1e100 | tojson }}{{ [] | tojson(indent=2) }}{{ {} | tojson(indent=2) }}", {}),
    ("{{ {'a': [1, {'b': none}], 'c': 'd'} | tojson(indent=4) }}|{{ {'a': [1, 2]} | tojson(indent='\\t') }}|{{ {1: 'int key', true: 'b'} | tojson }}|{{ (1, 2) | tojson }}", {}),
    ("{{ d | tojson }}|{{ d | tojson(indent=2, ensure_ascii=true) }}|{{ d.nested | tojson(4) }}", {"d": {"z": 1, "a": "é", "nested": {"x": [1.5, None, True], "y": {}}}}),
    ("{{ x | tojson }}", {"x": {"big": 12345678901234, "neg": -0.0, "small": 1e-10, "f": 3.0}}),
    # tests
    ("{{ x is string }}{{ x is sequence }}{{ x is mapping }}{{ x is number }}{{ true is number }}{{ true is integer }}{{ 1 is integer }}{{ 1.0 is float }}{{ none is none }}", {}),
    ("{{ 1 is odd }}{{ 4 is even }}{{ 4 is divisibleby 2 }}{{ 'a' in 'abc' }}{{ 2 is in [1, 2] }}{{ 'ab' is lower }}{{ 'AB' is upper }}{{ true is boolean }}{{ 1 is boolean }}{{ false is false }}{{ true is true }}", {}),
    ("{{ 1 is eq 1 }}{{ 1 is equalto 2 }}{{ x is undefined }}{{ 1 is sameas 1 }}{{ none is sameas none }}{{ 2 is gt 1 }}{{ 2 is lessthan 1 }}{{ 1 is ne 2 }}{{ 1 is ge 1 }}{{ 1 is le 0 }}{{ 1 is == 1 }}", {}),
    ("{{ 'abc' is iterable }}{{ 1 is iterable }}{{ {} is iterable }}{{ {} is mapping }}{{ [] is sequence }}{{ 'a' is sequence }}{{ 1 is sequence }}{{ range is callable }}{{ 'a' is callable }}{{ 'a'.upper is callable }}", {}),
    ("{{ 'trim' is filter }}{{ 'nosuch' is filter }}{{ 'odd' is test }}{{ 1 is not none }}{{ none is not none }}{{ not x is defined }}", {}),
    ("{{ 1 is nosuchtest }}", {}),
    ("{{ d.content is string }} {{ d.content is mapping or d.content is iterable }}", {"d": {"content": "text"}}),
    # loops
    ("{% for a, b in [[1, 2], [3, 4]] %}{{ a }}{{ b }}{% endfor %}{% for k, v in {'x': 1}.items() %}{{ k }}{{ v }}{% endfor %}", {}),
    ("{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}),
    ("{% for a, b in [[1]] %}{% endfor %}", {}),
    ("{% for x in [1, 2, 3, 4] if x is even %}{{ loop.index }}/{{ loop.length }}{{ loop.last }}{% else %}none{% endfor %}{% for x in [] %}{% else %}empty{% endfor %}", {}),
    ("{% for x in [1, 2, 3] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("{% for x in 'ab' %}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('o', 'e') }}{{ loop.depth }}{{ loop.depth0 }}{% endfor %}", {}),
    ("{% for x in [1, 1, 2] %}{{ loop.changed(x) }}{% endfor %}", {}),
    ("{% for x in [1, 2] %}{% for y in 'ab' %}{{ loop.index }}{{ x }}{{ y }} {% endfor %}{{ loop.index }}|{% endfor %}", {}),
    ("{% for x in {'b': 1, 'a': 2} %}{{ x }}{% endfor %}{% for c in 'héllo' %}[{{ c }}]{% endfor %}", {}),
    ("{% for x in 5 %}{% endfor %}", {}),
    ("{% for x in none %}{% endfor %}", {}),
    ("{% for x in [1, 2] %}{{ loop }}{% endfor %}", {}),
    ("{% for x in [1, 2] %}{% endfor %}{{ x }}|{{ loop }}|", {}),
    ("{% for m in messages[::-1] %}{{ (messages | length - 1) - loop.index0 }}{% endfor %}", {"messages": [1, 2, 3]}),
    ("{% for i in range(3) %}{{ i }}{% endfor %}{{ range(2, 10, 3) | list }}{{ range(5, 0, -2) | list }}{{ range(0) | list }}", {}),
    ("{{ range(100001) | length }}", {}),
    ("{% for x in [3, 1] | sort %}{{ x }}{% endfor %}{% for i in [1, 2, 3][1:] %}{{ i }}{% endfor %}", {}),
    # scoping and namespace
    ("{% set x = 1 %}{% for i in [1, 2, 3] %}{{ x }}{% set x = x + 10 %}{{ x }},{% endfor %}{{ x }}", {}),
    ("{% for i in [1, 2, 3] %}{% if i > 1 %}{{ y }}{% endif %}{% set y = i %}{% endfor %}|{{ y }}|", {}),
    ("{% set ns = namespace(a=1, found=false) %}{% for i in [1, 2] %}{% set ns.a = ns.a + i %}{% if i == 2 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.a }} {{ ns.found }} {{ ns }}", {}),
    ("{% set ns = namespace() %}{% set ns.index = 0 %}{{ ns.index }}{{ ns.missing }}|{{ ns['index'] }}", {}),
    ("{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}", {}),
    ("{% set x = 1 %}{% set x.y = 2 %}", {}),
    ("{{ ns.x }}{% set ns = namespace(a=1) %}{{ ns.b + 1 }}", {}),
    ("{% if true %}{% set x = 'in-if' %}{% endif %}{{ x }}", {}),
    ("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c = 1, 2 %}{{ c }}{% set (d, e) = [3, 4] %}{{ d }}{{ e }}", {}),
    ("{% set messages = messages[1:] %}{{ messages }}", {"messages": [1, 2, 3]}),
    ("{% set x %}  hi {{ 1 }}\n{% endset %}[{{ x }}]{% set y | upper %}abc{% endset %}{{ y }}", {}),
    ("{% filter upper %}abc {{ 'd' }}{% endfilter %}{% filter replace('a', 'b') | upper %}aaa{% endfilter %}", {}),
    ("{% with a = 1, b = 2 %}{{ a }}{{ b }}{% endwith %}[{{ a }}]", {}),
    ("{% generation %}assistant text {{ 1 }}{% endgeneration %}", {}),
    ("{% generation %}{% set g = 1 %}{{ g }}{% endgeneration %}[{{ g }}]", {}),
    # compile-time scoping (jinja2/idtracking.py): a later unconditional top-level set makes
    # the name missing for the whole frame, loops and macros included
    ("{{ x }}|{% set x = 5 %}{{ x }}", {"x": "hi"}),
    ("{% for i in [1] %}{{ x }}{% endfor %}|{% set x = 5 %}{{ x }}", {"x": "hi"}),
    ("{% if true %}{{ x }}{% endif %}|{% set x = 5 %}", {"x": "hi"}),
    ("{% for i in [1] %}{{ x }}{% set x = 2 %}{{ x }}{% endfor %}|{{ x }}", {"x": "hi"}),
    ("{% for i in [1] %}{% for j in [1] %}{{ x }}{% endfor %}{% endfor %}|{% set x = 5 %}", {"x": "hi"}),
    ("{% macro m() %}{{ x }}{% endmacro %}{{ m() }}|{% set x = 5 %}{{ m() }}", {"x": "hi"}),
    ("{% for i in [1] %}{{ x }}{% endfor %}{% if false %}{% set x = 5 %}{% endif %}", {"x": "hi"}),
    ("{% for i in [1] %}{{ x }}{% endfor %}{% if c %}{% set x = 1 %}{% else %}{% set x = 2 %}{% endif %}", {"x": "hi", "c": True}),
    ("{% for i in [1] %}{{ x }}{% endfor %}{% if c %}{% set x = 1 %}{% elif d %}{% set x = 3 %}{% else %}{% set x = 2 %}{% endif %}", {"x": "hi", "c": True}),
    # Jinja2 3.1.5 changed this: a name assigned in every branch (if, elifs and else) starts
    # from the context too (3.1.2 left it missing for the frame, as an unconditional set)
    ("{% macro m() %}{{ x }}{% endmacro %}{{ m() }}|{% if c %}{% set x = 1 %}{% elif d %}{% set x = 3 %}{% else %}{% set x = 2 %}{% endif %}{{ x }}|{{ m() }}", {"x": "hi", "c": False, "d": False}),
    ("{% for i in [1] %}{% for j in [1] %}{{ x }}{% endfor %}|{% if c %}{% set x = 1 %}{% elif d %}{% set x = 3 %}{% else %}{% set x = 2 %}{% endif %}{{ x }}{% endfor %}|{{ x }}", {"x": "hi", "c": False, "d": True}),
    ("{% with a = 1 %}{% for j in [1] %}{{ y }}{% endfor %}|{% if c %}{% set y = 1 %}{% elif d %}{% set y = 2 %}{% elif e %}{% set y = 3 %}{% else %}{% set y = 4 %}{% endif %}{{ y }}{% endwith %}", {"y": "hi", "c": False, "d": False, "e": True}),
    ("{% for i in [1] %}{% for j in [1] %}{{ x }}{% endfor %}{% set x = 1 %}{% endfor %}", {"x": "hi"}),
    ("{{ x }}{% for i in [1] %}{% for j in [1] %}{{ x }}{% endfor %}{% set x = 1 %}{% endfor %}", {"x": "hi"}),
    ("{% macro m() %}{% for j in [1] %}{{ y }}{% endfor %}{% set y = 2 %}{{ y }}{% endmacro %}{{ m() }}", {"y": "hi"}),
    ("{% set x %}{% for j in [1] %}{{ y }}{% endfor %}{% set y = 2 %}{% endset %}{{ x }}", {"y": "hi"}),
    ("{% with a = 1 %}{% for j in [1] %}{{ y }}{% endfor %}{% set y = 2 %}{% endwith %}", {"y": "hi"}),
    ("{% for i in [1] %}{% macro m() %}{{ y }}{% endmacro %}{{ m() }}{% set y = 3 %}{{ m() }}{% endfor %}", {"y": "hi"}),
    ("{% for i in [] %}{% else %}{{ y }}{% set y = 1 %}{{ y }}{% endfor %}|{{ y }}", {"y": "hi"}),
    ("{% for i in [] %}{% else %}{% for j in [1] %}{{ y }}{% endfor %}{% set y = 1 %}{% endfor %}", {"y": "hi"}),
    ("{% filter upper %}{% for j in [1] %}{{ y }}{% endfor %}{% set y = 'q' %}{{ y }}{% endfilter %}|{{ y }}", {"y": "hi"}),
    ("{% for i in [1] %}{{ ns.a }}{% endfor %}{% set ns = namespace(a=2) %}", {}),
    ("{% for i in [1] if x %}{{ i }}{% endfor %}{% set x = 5 %}", {"x": "hi"}),
    ("{% for i in x %}{{ i }}{% endfor %}{% set x = 5 %}", {"x": "hi"}),
    ("{% for i in [1] %}{{ x }}{% endfor %}{% set x, y = 5, 6 %}", {"x": "hi"}),
    ("{% for i in [1] %}{{ x }}{% endfor %}{% macro x() %}{% endmacro %}", {"x": "hi"}),
    # macros
    ("{% macro m(a, b='x') %}[{{ a }}{{ b }}{{ varargs }}{{ kwargs }}]{% endmacro %}{{ m(1) }}{{ m(1, 2, 3, z=4) }}{{ m(b=5, a=6) }}", {}),
    ("{% set x = 1 %}{% macro m() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ m() }}", {}),
    ("{% macro m(a) %}{{ a }}{% endmacro %}{{ m() }}|{{ m(1, 2) }}", {}),
    ("{% macro m(a) %}{{ a }}{% endmacro %}{{ m(b=1) }}", {}),
    ("{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1) | int }}{% endif %}{% endmacro %}{{ fact(5) }}", {}),
    ("{% macro render_tool(t) -%}\n  {{ t.name }}: {{ t.description | default('none') }}\n{%- endmacro %}\n{% for t in tools %}{{ render_tool(t) }};{% endfor %}", {"tools": [{"name": "a", "description": "d"}, {"name": "b"}]}),
    ("{% macro m(x, y=x * 2) %}{{ x }},{{ y }}{% endmacro %}{{ m(3) }} {{ m is callable }} {{ m }}", {}),
    # globals and errors raised by templates
    ("{{ raise_exception('boom: ' ~ 42) }}", {}),
    ("{% if true %}{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{% endif %}", {}),
    ("{{ raise_exception is callable }}|{{ strftime_now is defined }}|{{ namespace is defined }}|{{ dict(a=1, b=[2]) }}|{{ range(3) | list }}", {}),
    ("{% set j = joiner(', ') %}{% for x in [1, 2, 3] %}{{ j() }}{{ x }}{% endfor %}", {}),
    # syntax errors
    ("{% if %}", {}),
    ("{% for x in y %}", {}),
    ("{{ 1 + }}", {}),
    ("{% foo %}", {}),
    ("{% for x in y %}{% foo %}{% endfor %}", {}),
    ("{% for x in y %}{% endif %}{% endfor %}", {}),
    ("{{ x", {}),
    ("{{ 'a' @ }}", {}),
    ("a\nb\n{% if true %}\n{% endfor %}", {}),
    ("{% set x = %}", {}),
    ("{{ 'unterminated }}", {}),
    ("{# unclosed comment", {}),
    ("{{ a.1.b }}{{ (1, 2).0 }}{{ [[1]].0.0 }}", {"a": [0, {"b": "B"}]}),
    ("{{ foo(1 }}", {}),
    ("{% endfor %}", {}),
    ("{{ [1, 2 }}", {}),
    ("{{ 1 }} }}", {}),
    ("{% macro m(a=1, b) %}{% endmacro %}", {}),
    ("{% set true = 1 %}", {}),
    ("{{ x is is none }}", {}),
    # generators (map/select/reject/selectattr/rejectattr/batch/unique/items are lazy and single-use)
    ("{{ [1, 2] | map('string') | length }}", {}),
    ("{{ [1, 2] | select | last }}", {}),
    ("{{ [1, 2] | select | first }}|{{ [0, 1] | reject | first }}|{{ [] | select | first }}|", {}),
    ("{% set g = [1, 2] | select %}{{ g | list }}{{ g | list }}{{ g is iterable }}{{ g is sequence }}{{ g is mapping }}", {}),
    ("{{ 2.5 | reject('none') is defined }}|{{ 2.5 | select | first }}", {}),
    ("{{ 2.5 | reject('none') | list }}", {}),
    ("{{ [1, 2] | map('string') == ['1', '2'] }}|{{ [1, 2] | select | join('-') }}|{{ 2 in ([1, 2, 3] | select) }}", {}),
    ("{{ ([1] | select) + [1] }}", {}),
    ("{% for x in [{'r': 'u'}, {'r': 'a'}] | selectattr('r', 'ne', 'u') %}{{ loop.index }}{{ x.r }}{{ loop.last }}{% endfor %}", {}),
    ("{{ [1, 2, 3] | batch(2) | first }}|{{ 'abc' | batch(2) | list }}|{{ {'a': 1} | items | list }}", {}),
    ("{{ [3, 1] | map('string') | sort | join }}{{ ['a', 'b'] | map('upper') | reverse | join }}", {}),
    ("{{ x | map('upper') | list }}|{{ x | select | list }}|{{ x | items | list }}", {}),
    ("{{ messages | selectattr('role', 'equalto', 'user') | list | last }}", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
    # reverse iterators, dict views, range objects
    ("{{ [1, 2] | reverse | length }}", {}),
    ("{{ [1, 2] | reverse | list }}{{ (1, 2) | reverse | list }}{{ {'a': 1, 'b': 2} | reverse | list }}{{ range(3) | reverse | list }}{{ 'ab' | reverse }}", {}),
    ("{{ 5 | reverse }}", {}),
    ("{{ {'a': 1}.items() }}|{{ {'a': 1}.keys() }}|{{ {'a': 1}.values() }}|{{ {'a': 1}.items() | length }}|{{ 'a' in {'a': 1}.keys() }}|{{ {'a': 1}.items()[0] }}|", {}),
    ("{{ {'a': 1}.items() | tojson }}", {}),
    ("{{ 'x' ~ {'a': 1}.values() }}|{{ {'a': 1}.keys() | list == ['a'] }}|{{ {'a': 1}.keys() == {'a': 2}.keys() }}|{{ {'a': 1}.values() is sequence }}", {}),
    ("{{ 'x' + {'a': 1}.values() }}", {}),
    ("{{ range(3) }}|{{ range(1, 5, 2) }}|{{ range(3)[1] }}|{{ range(3) | length }}|{{ range(10)[2:8:2] }}|{{ range(10)[::-1] }}|{{ range(3)[-1] }}", {}),
    ("{{ range(3) | tojson }}", {}),
    ("{{ range(3) + [1] }}", {}),
    # Jinja2's compile-time constant folding (optimizer.py) and its code generator's quirks
    ("{{ 0[1:2] }}|{{ 7[:-1] }}|{{ none[1:] }}|{{ {}[:-1] }}|{{ 7[:-1] is defined }}|{{ 'a' if 7[:-1] else 'b' }}|{{ x if 7[:-1] else 'b' }}", {}),
    ("{{ n[1:2] }}", {"n": 7}),
    ("{{ 3[:-1] - x }}", {}),
    ("{{ false[1:2] | replace('a', 'b') }}|{{ (true[1:] is not callable) }}", {}),
    ("{{ 0.1[:-1] | float }}", {}),
    ("{% if 7[:-1] %}yes{% endif %}", {}),
    ("{{ (-2) ** n }}|{{ -2 ** n }}|{{ (-0.0) ** n }}|{{ -2 ** 2 }}|{{ (-2) ** 2 }}|{{ 2 ** -n }}|{{ x ** n }}", {"n": 2, "x": -2}),
    # evaluation order, hashing, Undefined in operators
    ("{{ ({'k': 1} < 1) ** ('a' + -2) }}", {}),
    ("{{ ('a' + -2) ** ({'k': 1} < 1) }}", {}),
    ("{{ {} in {'k': 1} }}", {}),
    ("{{ [1] in {'k': 1} }}", {}),
    ("{{ u in 'abc' }}", {}),
    ("{{ '%s|%r' % (u, u) }}|{{ 'plain' % u }}|{{ 'x' % [1, 2] }}|{{ 'y' % {'a': 1} }}", {}),
    ("{{ '%d' % u }}", {}),
    ("{{ 'x' % 5 }}", {}),
    ("{{ u | abs }}", {}),
    ("{{ u | int }}", {}),
    ("{{ u | float }}", {}),
    ("{{ u | round }}", {}),
    ("{{ u is callable }}|{{ 'abc' * 'x' if false else 1 }}", {}),
    ("{{ 'ab' * 'x' }}", {}),
    ("{{ 2.5 * [1] }}", {}),
    ("{{ ['b', 1] | max }}", {}),
    ("{{ ['b', 1] | min }}", {}),
    ("{{ 5 % 0 }}", {}),
    ("{{ 10.0 ** 400 }}", {}),
    ("{{ 5 | indent }}", {}),
    ("{{ u | indent }}", {}),
    ("{{ (1, 2) | indent }}", {}),
    ("{{ (n - -2) | truncate(5) }}", {"n": 3}),
    ("{{ 'x' | nosuch if false }}|{% if false %}{{ 'x' | nosuch }}{{ 1 is nosuchtest }}{% endif %}|{% if true %}{% elif false %}{{ 1 | nosuch }}{% endif %}|{{ 1 | nosuch if false else 2 }}", {}),
    ("{{ 'x' | nosuch if true }}", {}),
    ("{% if 'x' | nosuch %}{% endif %}", {}),
    ("{% if false %}{% else %}{{ 1 | nosuch }}{% endif %}", {}),
    ("{% if false %}{% for i in [1] %}{{ i | nosuch }}{% endfor %}{% endif %}", {}),
    ("{% if false %}{% macro m() %}{{ 1 | nosuch }}{% endmacro %}{% endif %}", {}),
    ("{% if false %}{% set y | nosuch %}a{% endset %}{% endif %}", {}),
    # markupsafe.Markup from |escape and |safe
    ("{{ 'a<' | escape }}|{{ ('a' | escape) + '<b>' }}|{{ '<i>' + ('&' | safe) }}|{{ ('%s!' | safe) % '<x>' }}|{{ ('a' | e) * 2 }}|{{ 1 | safe }}", {}),
    ("{{ ('a' | escape) / 1 }}", {}),
    ("{{ ('a' | safe) + 1 }}", {}),
    ("{{ 'a' | escape is string }}|{{ ('<' | escape) | length }}|{{ ('<' | escape) ~ '<' }}|{{ ('<' | e) == '&lt;' }}", {}),
    # message-like data
    ("{% for m in messages %}{{ m.role }}:{{ m['content'] }}|{% endfor %}", {"messages": [{"role": "user", "content": "{{ 7*7 }}"}, {"role": "assistant", "content": "{% raw %}"}]}),
    ("{{ m.content.split('</think>')[-1].lstrip('\\n') }}|{{ m.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}", {"m": {"content": "<think>\nreason\n</think>\n\nanswer"}}),
    ("{% if '</think>' in m.content %}yes{% endif %}", {"m": {"content": None}}),
    ("{{ m.tool_calls | length }} {{ m.tool_calls[0].function.arguments | tojson }} {{ m.tool_calls[0].function.name }}", {"m": {"tool_calls": [{"function": {"name": "f", "arguments": {"b": [1, 2], "a": "x"}}}]}}),
    ("{{ m == other }} {{ m == same }}", {"m": {"role": "user", "content": "a"}, "other": {"role": "user", "content": "b"}, "same": {"content": "a", "role": "user"}}),
    ("{{ data }}|{{ data.n }}|{{ data.f }}|{{ data.b }}|{{ data.l }}|{{ data.e }}", {"data": {"n": None, "f": 1.0, "b": False, "l": [1, "a", None], "e": {}}}),
]


def snippet_cases():
    out = []
    for source, context in SNIPPETS:
        case = {"template": source, "context": context}
        case.update(render(source, context))
        out.append(case)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "expected.json"))
    args = ap.parse_args()
    fixture = {
        "generator": f"render_reference.py, Jinja2 {jinja2.__version__}, Python {sys.version.split()[0]}",
        "templates": {name: {"file": spec[0], "special_tokens": spec[1]} for name, spec in TEMPLATES.items()},
        "conversations": CONVERSATIONS,
        "extras": EXTRAS,
        "chat_cases": chat_cases(),
        "snippets": snippet_cases(),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    n_chat = len(fixture["chat_cases"])
    n_err = sum(1 for c in fixture["chat_cases"] if "error" in c)
    print(f"{args.out}: {n_chat} chat cases ({n_err} errors), {len(fixture['snippets'])} snippets")


if __name__ == "__main__":
    main()
