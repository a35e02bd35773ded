#!/usr/bin/env python3
"""python.wheel: the package as `pip install .` makes it, around this build's program.

    install_wheel.py PROGRAM SITE

pip builds the wheel with scikit-build-core (pyproject.toml) in this environment
(--no-build-isolation: its torch and scikit-build-core), packaging PROGRAM
(REPLICA_PREBUILT_CLI) instead of building the C++ project again, and installs it into SITE
(--target: this environment is left as it was). Then checks the installed package: `import
replica` finds the packaged program, `python -m replica --version` runs it.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    program, site = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    if not program.is_file():
        print(f"{program} is not built (ninja -C build replica_cli)", file=sys.stderr)
        return 1
    for module, package in (("scikit_build_core", "scikit-build-core"), ("pydantic", "pydantic")):
        try:
            __import__(module)
        except ImportError:  # installed --no-deps below: the package's dependencies come from here
            print(f"{package} is not installed: pip install -r scripts/requirements-test.txt", file=sys.stderr)
            return 1
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--no-build-isolation", "--no-deps", "--no-cache-dir", "--target", str(site),
                    "-C", f"cmake.define.REPLICA_PREBUILT_CLI={program}", str(ROOT)], check=True)
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("REPLICA_BINARY", None)
    where = subprocess.run([sys.executable, "-c", "import replica; print(replica.binary())"], env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).resolve() == (site / "replica" / "_bin" / "replica").resolve(), where
    version = subprocess.run([sys.executable, "-m", "replica", "--version"], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
    expected = subprocess.run([str(program), "--version"], capture_output=True, text=True, check=True).stdout.strip()
    assert version == expected, (version, expected)
    print(f"python.wheel: {site}: {where} ({version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
