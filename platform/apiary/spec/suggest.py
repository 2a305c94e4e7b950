""""Did you mean": the known names closest to a misspelt one, for the 400 of an unknown field.

:func:`close_names` is :func:`difflib.get_close_matches` (its ratio cut-off 0.6, at most three,
best first). :func:`field_names_at` finds which field names a pydantic model accepts at an error's
location (``("taskRoles", "train", "resourcePerInstanse")`` -> the fields of a task role's
``resourcePerInstance``'s parent, a task role), walking the model's annotations: models, lists,
dicts, optionals and (discriminated) unions. Wire names are the aliases (camelCase).
"""

from __future__ import annotations

import difflib
import inspect
import types
from collections.abc import Sequence
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

#: difflib's default: below this similarity (0..1) a name is not offered.
CUTOFF = 0.6
#: At most this many suggestions.
MAX_SUGGESTIONS = 3


def close_names(name: str, known: Sequence[str]) -> list[str]:
    """The names of ``known`` closest to ``name`` (difflib, best first; ``[]`` when none is close)."""
    return difflib.get_close_matches(name, list(known), n=MAX_SUGGESTIONS, cutoff=CUTOFF)


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the close names of ``known``, or ``""`` when none is."""
    matches = close_names(name, known)
    if not matches:
        return ""
    quoted = [repr(m) for m in matches]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"; did you mean {listed}?"


def _is_model(tp: Any) -> bool:
    return inspect.isclass(tp) and issubclass(tp, BaseModel)


def _wire_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _members(tp: Any) -> list[Any]:
    """``tp`` without Annotated / Optional wrappers, a union as its members."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _members(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        return [m for arg in get_args(tp) if arg is not type(None) for m in _members(arg)]
    return [tp]


def _step(tp: Any, part: int | str) -> list[Any]:
    """The types one location step below ``tp`` (several for a union)."""
    out: list[Any] = []
    for member in _members(tp):
        if _is_model(member):
            if isinstance(part, str):
                for name, f in member.model_fields.items():
                    if part in (name, f.alias):
                        out.append(f.annotation)
            continue
        origin, args = get_origin(member), get_args(member)
        if origin in (list, tuple, set, frozenset) and isinstance(part, int) and args:
            out.append(args[0])
        elif origin is dict and len(args) == 2:
            out.append(args[1])
    return out


def field_names_at(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The wire names the model at ``loc`` (a pydantic error's location, without the unknown name
    itself) accepts; ``[]`` when the location cannot be followed. A step no member of a union
    takes (pydantic's tag of a discriminated union, ``"[key]"``) is skipped."""
    current: list[Any] = [model]
    for part in loc:
        below = [t for tp in current for t in _step(tp, part)]
        if below:
            current = below
        elif not isinstance(part, str):
            return []
    names: list[str] = []
    for tp in current:
        for member in _members(tp):
            if _is_model(member):
                names += [n for n in _wire_names(member) if n not in names]
    return names
