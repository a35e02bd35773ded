"""AutoTrain-style parameter classes, one per task, built from the task registry.

``LLMTrainingParams`` has AutoTrain's field names and replica's defaults (which follow
AutoTrain's): every flag ``replica llm --train`` takes, i.e. the run's own flags (``model``,
``project_name``, ``data_path``, ...), every ``params:`` key of task llm-sft, the params twins
``chat_template`` and ``text_column``, and AutoTrain's fields that replica accepts only at
their default (``push_to_hub=False``, ...). ``ImageClassificationParams`` and
``TwoTowerParams`` are the same for ``replica --config`` of those tasks. The field table is
``_fields.py``, generated from ``replica keys TASK --json``; a test fails when a key exists on
one side only.

Python checks names and types (an unknown field names the nearest valid one); the values
themselves are checked by replica, whose message a refused value raises as ``ConfigError``.
``None`` leaves a field at replica's default, except where null means something
(``valid_split=None``: no evaluation).
"""

from __future__ import annotations

import copy
import difflib
import shlex
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Tuple

from ._fields import TASKS
from .errors import ConfigError

# Run fields whose None is a value of its own (YAML null), not "replica's default".
_NULLABLE = {"valid_split"}


@dataclass(frozen=True)
class Field:
    """One field: its flag, default, help, and which part of the command line it is."""

    name: str
    flag: str
    default: Any
    help: str
    section: str  # run | params | twin | autotrain
    hint: str = ""
    kind: str = ""
    switch: bool = False
    secret: bool = False
    known_as: Tuple[str, ...] = ()
    accepted: Optional[str] = None  # autotrain: the one value replica accepts ("" = none)

    def check(self, owner: str, value: Any) -> Any:
        """The value as stored, or ConfigError naming the field and what it takes."""
        if value is None:
            return None
        if self.section == "autotrain":
            return value
        hint = self.hint
        expected = self._expected()
        ok = False
        if expected == "bool":
            ok = isinstance(value, bool)
        elif expected in ("int", "int|auto"):
            ok = (isinstance(value, int) and not isinstance(value, bool)) or (expected == "int|auto" and value == "auto")
        elif expected == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif expected == "bool|auto":
            ok = isinstance(value, bool) or value == "auto"
        elif expected == "ints":
            if isinstance(value, str):
                ok = all(p.strip().isdigit() for p in value.strip().strip("[]").split(","))
                value = [int(p) for p in value.strip().strip("[]").split(",")] if ok else value
            else:
                ok = isinstance(value, (list, tuple)) and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in value)
                value = list(value) if ok else value
        elif expected == "strs":
            ok = isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))
            if ok and not isinstance(value, str):
                value = ",".join(value)  # AutoTrain's form (and the registry's default's)
        else:  # a string, an enumeration's name
            ok = isinstance(value, str)
        if not ok:
            what = {
                "bool": "True or False",
                "int": "an integer",
                "int|auto": "an integer or 'auto'",
                "float": "a number",
                "bool|auto": "True, False or 'auto'",
                "ints": "a list of positive integers",
                "strs": "a list of names or a comma-separated string",
            }.get(expected, "one of " + ", ".join(hint.split("|")) if "|" in hint else "a string")
            raise ConfigError(f"{owner}.{self.name} must be {what}, got {value!r}")
        return value

    def _expected(self) -> str:
        if self.switch:
            return "bool"
        hint = self.hint
        if hint == "true|false|auto":
            return "bool|auto"
        if hint == "N,N,...":
            return "ints"
        if hint == "A,B,...":
            return "strs"
        if hint == "N":
            return "int"
        if hint == "X":
            return "float"
        if "|" in hint and "auto" in hint.split("|") and any(p == "N" or p.isdigit() for p in hint.split("|")):
            return "int|auto"
        return "str"

    def text(self, value: Any) -> str:
        """The value as the flag takes it."""
        if value is None:
            return "none"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (list, tuple)):
            # A YAML list: the flag reads `256,128` as one too, but a single `64` as a number.
            return "[" + ",".join(str(v) for v in value) + "]"
        if isinstance(value, float):
            return repr(value)
        return str(value)


def _fields_of(task: str) -> Dict[str, Field]:
    spec = TASKS[task]
    fields: Dict[str, Field] = {}
    for entry in spec["run"]:
        default = entry["default"]
        if default == "":
            default = None  # required (model, project_name) or the program decides
        fields[entry["name"]] = Field(entry["name"], entry["flag"], default, entry["help"], "run")
    for entry in spec["keys"]:
        fields[entry["name"]] = Field(
            entry["name"], entry["flag"], entry["default"], entry["help"], "params", hint=entry["hint"],
            kind=entry["kind"], switch=entry["switch"], secret=entry["secret"],
            known_as=tuple(entry.get("known_as", ())))
    for entry in spec["twins"]:
        fields[entry["name"]] = Field(entry["name"], entry["flag"], entry["default"], entry["help"], "twin")
    for entry in spec["autotrain_only"]:
        accepted = entry["accepted"]
        default = {"false": False, "true": True, "": None}.get(accepted, accepted)
        fields[entry["name"]] = Field(entry["name"], entry["flag"], default, entry["why"], "autotrain",
                                      accepted=accepted)
    return fields


class Params:
    """The parameters of one run of a task. Fields are attributes; see ``fields()``."""

    task: ClassVar[str] = ""
    _fields: ClassVar[Dict[str, Field]] = {}

    def __init__(self, **values: Any):
        object.__setattr__(self, "_values", {name: copy.deepcopy(f.default) for name, f in self._fields.items()})
        for name, value in values.items():
            setattr(self, name, value)

    # ---- fields

    @classmethod
    def fields(cls) -> List[str]:
        """Every field name, in the order ``replica keys`` lists them."""
        return list(cls._fields)

    @classmethod
    def field(cls, name: str) -> Field:
        try:
            return cls._fields[name]
        except KeyError:
            raise ConfigError(cls._unknown(name)) from None

    @classmethod
    def _unknown(cls, name: str) -> str:
        message = f"unknown field '{name}' of {cls.__name__} (task {cls.task})"
        for f in cls._fields.values():
            if name in f.known_as:
                return message + f" (did you mean '{f.name}'?)"
        close = difflib.get_close_matches(name, list(cls._fields), n=1, cutoff=0.6)
        if close:
            return message + f" (did you mean '{close[0]}'?)"
        return message + f"; see {cls.__name__}.fields()"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(self._unknown(name))

    def __setattr__(self, name: str, value: Any) -> None:
        f = self.field(name)
        self._values[name] = f.check(type(self).__name__, value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._values == other._values  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self._changed())
        return f"{type(self).__name__}({changed})"

    def to_dict(self) -> Dict[str, Any]:
        """Every field and its value (the token left out)."""
        return {k: copy.deepcopy(v) for k, v in self._values.items() if not self._fields[k].secret}

    model_dump = to_dict  # pydantic's name (AutoTrain's params are pydantic models)

    def copy(self, **changes: Any) -> "Params":
        out = copy.deepcopy(self)
        for name, value in changes.items():
            setattr(out, name, value)
        return out

    # ---- the command line

    def _changed(self) -> Iterable[Tuple[str, Any]]:
        for name, f in self._fields.items():
            value = self._values[name]
            if value is None and f.default is not None and name not in _NULLABLE:
                continue  # None: replica's default
            if value != f.default:
                yield name, value

    def flags(self) -> List[str]:
        """The flags that set every field not at its default, as the command line takes them."""
        out: List[str] = []
        for name, value in self._changed():
            f = self._fields[name]
            out += [f.flag, f.text(value)]
        return out

    def command(self, config_file: Optional[str] = None) -> List[str]:
        """replica's arguments for this run: ``llm --train FLAGS`` for llm-sft, ``--config
        FILE FLAGS`` for the other tasks (FILE holds only ``task:``; see ``config_yaml``)."""
        if self.task == "llm-sft":
            return ["llm", "--train", *self.flags()]
        if config_file is None:
            raise ConfigError(f"task {self.task} runs from a config file: pass config_file")
        return ["--config", config_file, *self.flags()]

    def config_yaml(self) -> Optional[str]:
        """The file ``--config`` reads for tasks that are not llm-sft (the task; every other
        field is a flag), or None for llm-sft."""
        return None if self.task == "llm-sft" else f"task: {self.task}\n"

    @property
    def project_dir(self) -> Optional[str]:
        return self._values.get("project_name")

    @classmethod
    def from_args(cls, args: Iterable[str]) -> "Params":
        """The params a command line's flags give (``--lora-r 16 --peft``; ``--x-y`` or
        ``--x_y``); ``llm``, ``--train`` and ``--config FILE`` are skipped."""
        args = list(shlex.split(args) if isinstance(args, str) else args)
        if args and args[0] == "replica":
            args = args[1:]
        out = cls()
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if arg in ("llm", "--train"):
                continue
            if arg == "--config":
                i += 1
                continue
            if not arg.startswith("--"):
                raise ConfigError(f"unexpected argument '{arg}' (flags look like --lora-r 16)")
            name, _, value = arg[2:].partition("=")
            name = name.replace("-", "_")
            f = cls.field(name)
            if not value:
                if i < len(args) and not args[i].startswith("--"):
                    value = args[i]
                    i += 1
                elif f.switch:
                    value = "true"
                else:
                    raise ConfigError(f"flag {arg} needs a value")
            setattr(out, name, _parse(f, value))
        return out


def _parse(f: Field, text: str) -> Any:
    """A flag's text as the field's Python value."""
    kind = f._expected()
    low = text.lower()
    if kind in ("bool", "bool|auto"):
        if low in ("true", "yes", "on", "1"):
            return True
        if low in ("false", "no", "off", "0"):
            return False
        return text
    if kind in ("int", "int|auto"):
        try:
            return int(text)
        except ValueError:
            return text
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            return text
    if kind == "ints":
        try:
            return [int(p) for p in text.strip().strip("[]").split(",")]
        except ValueError:
            return text
    if f.name in _NULLABLE and low in ("none", "null"):
        return None
    return text


def _params_class(name: str, task: str, doc: str) -> type:
    fields = _fields_of(task)
    lines = [doc, "", "Fields (defaults as ``replica keys " + task + "`` prints them):", ""]
    for f in fields.values():
        if f.section == "autotrain":
            lines.append(f"- ``{f.name}`` [{f.default!r}]: accepted at this value only: {f.help}")
        else:
            shown = "required" if f.default is None and f.section == "run" and f.name in ("model", "project_name") else repr(f.default)
            lines.append(f"- ``{f.name}`` [{shown}]: {f.help}")
    return type(name, (Params,), {"task": task, "_fields": fields, "__doc__": "\n".join(lines),
                                  "__module__": __name__})


LLMTrainingParams = _params_class(
    "LLMTrainingParams", "llm-sft",
    "AutoTrain's LLMTrainingParams: supervised fine-tuning (full or LoRA) of a Hugging Face model directory.")
ImageClassificationParams = _params_class(
    "ImageClassificationParams", "image-classification",
    "Image classification (MLP or ResNet-18 on Fashion-MNIST idx files).")
TwoTowerParams = _params_class(
    "TwoTowerParams", "two-tower", "The two-tower recommender (MDS shards or JSONL).")

PARAMS_CLASSES = {cls.task: cls for cls in (LLMTrainingParams, ImageClassificationParams, TwoTowerParams)}
