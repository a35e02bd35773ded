"""A run as data that travels to workers on other machines (Spark executors, Ray actors).

A job is replica's arguments with the configuration file carried as text: a YAML path given on
the driver may not exist on a worker, and a params object's ``task:`` file is written where the
worker runs. Paths inside the configuration are resolved against the driver's working
directory, which the workers use when it exists there (Spark local mode, one machine, a shared
file system mounted at the same path).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .errors import ConfigError
from .params import PARAMS_CLASSES, Params

CONFIG_PLACEHOLDER = "{config}"


@dataclass
class Job:
    args: List[str]                   # replica's arguments; CONFIG_PLACEHOLDER for the config file
    config_name: Optional[str] = None  # the file's base name (messages name it)
    config_text: Optional[str] = None
    config_path: Optional[str] = None  # absolute, on the driver
    cwd: str = ""                     # the driver's working directory
    project_dir: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    failure_dir: Optional[str] = None  # on the driver: a failed worker that sees it leaves its record there

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "Job":
        return Job(**d)

    def materialize(self, scratch: str) -> Tuple[List[str], Optional[str]]:
        """The arguments with the config file in place, and the directory to run in."""
        args = list(self.args)
        if CONFIG_PLACEHOLDER in args:
            path = self.config_path
            if not path or not os.path.isfile(path):
                path = os.path.join(scratch, self.config_name or "run.yaml")
                Path(path).write_text(self.config_text or "")
            args = [path if a == CONFIG_PLACEHOLDER else a for a in args]
        cwd = self.cwd if self.cwd and os.path.isdir(self.cwd) else None
        return args, cwd


def _flag_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"  # a YAML list, also of one
    return str(value)


def override_flags(overrides: Union[None, Mapping[str, Any], List[str]]) -> List[str]:
    """``{"max_steps": 20}`` (or ``["--max-steps", "20"]``) as flags."""
    if not overrides:
        return []
    if isinstance(overrides, (list, tuple)):
        return [str(a) for a in overrides]
    out: List[str] = []
    for name, value in overrides.items():
        out += ["--" + name.replace("_", "-"), _flag_text(value)]
    return out


def _project_name_of(yaml_text: str, flags: List[str]) -> Optional[str]:
    """project_name of a YAML file with the flags over it (a top-level key)."""
    for i, a in enumerate(flags):
        if a in ("--project-name", "--project_name") and i + 1 < len(flags):
            return flags[i + 1]
        if a.startswith(("--project-name=", "--project_name=")):
            return a.split("=", 1)[1]
    match = re.search(r"^project_name:\s*(.+?)\s*(?:#.*)?$", yaml_text, re.MULTILINE)
    if not match:
        return None
    return match.group(1).strip().strip("'\"")


def job_of(config_or_params: Union[str, os.PathLike, Params], overrides=None, device: Optional[str] = None) -> Job:
    """The job of a YAML file or a params object, with ``overrides`` applied as flags and
    ``device`` (when given and not overridden) as ``--device``."""
    flags = override_flags(overrides)
    if device and not any(f in ("--device",) or f.startswith("--device=") for f in flags):
        flags += ["--device", device]
    cwd = os.getcwd()
    if isinstance(config_or_params, Params):
        params = config_or_params
        yaml_text = params.config_yaml()
        if yaml_text is None:
            args = params.command() + flags
            job = Job(args=args, cwd=cwd)
        else:
            args = params.command(CONFIG_PLACEHOLDER) + flags
            job = Job(args=args, config_name=f"{params.task}.yaml", config_text=yaml_text, cwd=cwd)
        project = params.project_dir
        for i, a in enumerate(flags):  # an override of project_name wins
            if a in ("--project-name", "--project_name") and i + 1 < len(flags):
                project = flags[i + 1]
        job.project_dir = _absolute(project, cwd)
        return job
    if isinstance(config_or_params, (str, os.PathLike)):
        path = Path(config_or_params)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        text = path.read_text()
        return Job(args=["--config", CONFIG_PLACEHOLDER, *flags], config_name=path.name, config_text=text,
                   config_path=str(path.resolve()), cwd=cwd,
                   project_dir=_absolute(_project_name_of(text, flags), cwd))
    raise ConfigError(
        f"expected a YAML file or one of {', '.join(c.__name__ for c in PARAMS_CLASSES.values())}, "
        f"got {type(config_or_params).__name__}")


def _absolute(path: Optional[str], cwd: str) -> Optional[str]:
    if not path:
        return None
    return path if os.path.isabs(path) else os.path.join(cwd, path)
