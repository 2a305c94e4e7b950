"""The run records every backend keeps under ``state_dir/<run_id>/``: the run id rule and
crash-safe JSON files (written to a temporary name, fsync-ed, renamed over the old one, so a
reader sees the old record or the new one, never half of one)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

#: A run id: 1-200 ASCII letters, digits and ``~ . - _``, not starting with ``.`` (it names a
#: directory: no ``/``, no ``..``, no hidden file).
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_~\-][A-Za-z0-9_~.\-]{0,199}$")


def valid_run_id(run_id: object) -> bool:
    return isinstance(run_id, str) and bool(RUN_ID_RE.match(run_id))


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably. Raises OSError."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """:func:`write_atomic` of ``data`` as one line of JSON."""
    write_atomic(path, json.dumps(data) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; ``None`` when missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
