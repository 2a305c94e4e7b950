"""examples/stress/bench.py loaded as a module (it is a script, not a package), for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "examples" / "stress" / "bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("apiary_stress_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there while the class is made
    spec.loader.exec_module(mod)
    return mod


bench = _load()
