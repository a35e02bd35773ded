"""``python -m replica ARGS`` (and the ``replica`` command the package installs): the program
itself, with the installed torch's LibTorch on its library path."""

import os
import sys

from . import _binary
from .errors import ReplicaError


def main() -> None:
    try:
        program = _binary.binary()
    except ReplicaError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    os.execve(program, [program, *sys.argv[1:]], _binary.environment())


if __name__ == "__main__":
    main()
