"""Where the ``replica`` program is, and the environment it runs in.

The wheel carries the program in ``replica/_bin/replica``. It is linked against the LibTorch of
PyTorch's wheel: a wheel built from source has the run path ``$ORIGIN/../../torch/lib`` (the
``torch`` package beside ``replica`` in site-packages), and every start from here also puts the
installed torch's ``lib`` (and the CUDA runtime of its ``nvidia`` packages) first on
``LD_LIBRARY_PATH``, so the program always loads the LibTorch of the torch this Python imports.
``REPLICA_BINARY`` names another program (a build tree's ``build/replica``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Dict, List, Mapping, Optional

from .errors import ReplicaError

_PACKAGE_DIR = Path(__file__).resolve().parent


def binary() -> str:
    """The path of the ``replica`` program this package runs."""
    override = os.environ.get("REPLICA_BINARY")
    if override:
        if not os.access(override, os.X_OK):
            raise ReplicaError(f"REPLICA_BINARY={override} is not an executable file")
        return override
    packaged = _PACKAGE_DIR / "_bin" / "replica"
    if packaged.is_file():
        return str(packaged)
    raise ReplicaError(
        f"the replica program is not in this package ({packaged} is missing): install the package with "
        "`pip install .` from a replica checkout, or set REPLICA_BINARY to a built program"
    )


def _package_dirs(name: str) -> List[Path]:
    """The directories of an installed package, found without importing it (importing torch
    takes seconds; a namespace package such as ``nvidia`` may have several)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def library_dirs() -> List[str]:
    """torch/lib of the installed torch wheel, then the CUDA runtime of its nvidia packages."""
    dirs: List[str] = []
    for torch_dir in _package_dirs("torch"):
        if (torch_dir / "lib").is_dir():
            dirs.append(str(torch_dir / "lib"))
    for nvidia_dir in _package_dirs("nvidia"):
        for sub in sorted(nvidia_dir.glob("cu*/lib")) + sorted(nvidia_dir.glob("cuda_runtime/lib")):
            dirs.append(str(sub))
    return dirs


def environment(extra: Optional[Mapping[str, str]] = None, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment to start ``replica`` in: ``base`` (default: this process's) with
    ``extra`` over it, and the installed torch's libraries first on ``LD_LIBRARY_PATH``."""
    env = dict(os.environ if base is None else base)
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    dirs = library_dirs()
    if dirs:
        current = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + [d for d in current if d not in dirs])
    return env


def command(args: List[str]) -> List[str]:
    """``[program, *args]``."""
    return [binary(), *[str(a) for a in args]]
