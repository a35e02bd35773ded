#!/usr/bin/env python3
"""Regenerates the key table of docs/cli.md (between its KEYS-TABLE markers) from
`replica keys TASK` of every task, so that the page lists what the key tables declare.

    scripts/keys_table.py [build/replica]
"""
import collections
import re
import subprocess
import sys

BIN = sys.argv[1] if len(sys.argv) > 1 else "build/replica"
TASKS = ["llm-sft", "image-classification", "two-tower"]
PAGE = "docs/cli.md"
BEGIN, END = "<!-- KEYS-TABLE begin: scripts/keys_table.py -->", "<!-- KEYS-TABLE end -->"


def esc(text):
    return text.replace("|", "\\|")


rows = collections.OrderedDict()
for task in TASKS:
    out = subprocess.run([BIN, "keys", task], capture_output=True, text=True, check=True).stdout
    entries, current = [], None
    for line in out.split("\n")[1:]:
        if not line.strip() or not line.startswith(" "):
            continue
        if line.startswith("  --"):
            # "--flag HINT", then the help after two or more spaces (on the next line when the
            # flag is wider than its column).
            m = re.match(r"  (--\S+(?: \S+)?)(?:\s{2,}(.*)|\s*)$", line)
            current = [m.group(1), (m.group(2) or "").strip()]
            entries.append(current)
        else:
            current[1] = (current[1] + " " + line.strip()).strip()
    for flag, text in entries:
        m = re.match(r"(.*?)(?: \[(.*)\])?$", text)
        what, default = m.group(1), m.group(2) or ""
        key = (flag.split()[0], what)
        if key in rows:
            rows[key]["tasks"].append(task)
            rows[key]["defaults"][task] = default
        else:
            rows[key] = {"flag": flag, "what": what, "tasks": [task], "defaults": {task: default}}

lines = ["| flag | default | what it does | tasks |", "|---|---|---|---|"]
for row in rows.values():
    defaults = row["defaults"]
    if len(set(defaults.values())) == 1:
        default = next(iter(defaults.values()))
    else:
        default = "; ".join(f"{v} ({t})" for t, v in defaults.items())
    tasks = "all" if len(row["tasks"]) == len(TASKS) else ", ".join(row["tasks"])
    lines.append(f"| `{esc(row['flag'])}` | {esc(default)} | {esc(row['what'])} | {tasks} |")

page = open(PAGE).read()
start, stop = page.index(BEGIN) + len(BEGIN), page.index(END)
open(PAGE, "w").write(page[:start] + "\n" + "\n".join(lines) + "\n" + page[stop:])
print(f"{PAGE}: {len(rows)} keys")
