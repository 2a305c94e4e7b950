"""examples/mnist/main.py as a module (``examples`` is no package), for tests that call its
functions in process: ``main``, ``load_model``, ``split``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

MAIN = Path(__file__).resolve().parents[2] / "examples" / "mnist" / "main.py"


def load_mnist() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mnist_main", MAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
