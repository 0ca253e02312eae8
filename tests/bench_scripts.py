"""The study scripts under ``bench/`` (a folder of scripts, not a package), imported by name."""

from __future__ import annotations

import importlib
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def load(name: str):
    """``bench/<name>.py`` as module ``name`` (the folder goes on ``sys.path``, so
    processes the script spawns import it by name too)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module(name)
