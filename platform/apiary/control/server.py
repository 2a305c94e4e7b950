"""Where the CLI found the control-plane process before :mod:`apiary.wiring` became its composition
root: :func:`serve` and :func:`build_plane` are :mod:`apiary.wiring`'s. Kept only until the CLI
imports :func:`apiary.wiring.serve` itself; then this module goes (it imports upward)."""

from __future__ import annotations

from apiary.wiring import build_plane, serve

__all__ = ["build_plane", "serve"]
