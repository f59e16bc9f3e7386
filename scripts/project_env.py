"""Imported first by every script: the project's environment whatever ``python`` started it.

The README's commands read ``python scripts/...``; without ``source .venv/bin/activate`` that
is the system's Python, which lacks the project's packages. Then the script starts again under
``.venv/bin/python`` with the same arguments; without a ``.venv/`` it stops, saying how to make
one. Under any Python that has the packages (``.venv/``, a conda environment) it does nothing.
"""
import importlib.util
import os
import sys
from pathlib import Path

VENV = Path(__file__).resolve().parents[1] / ".venv"

if importlib.util.find_spec("hydra") is None:  # a package of the project's environment only
    python = VENV / "bin" / "python"
    if not python.exists() or Path(sys.prefix).resolve() == VENV.resolve():
        sys.exit(f"{sys.executable} lacks the project's packages: run `make run` (it installs "
                 f".venv/), then `source .venv/bin/activate`")
    os.execv(python, [str(python), *sys.argv])
