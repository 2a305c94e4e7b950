"""OpenPAI protocol templating: ``<% $parameters.x %>`` references in job text.

OpenPAI's REST server renders a job's commands with mustache-style tags ``<%`` ``%>`` against
``$parameters`` and ``$secrets`` (shared by all task roles) and ``$script``, ``$data``,
``$output`` (the prerequisites the task role selects); see the ``parameters``, ``secrets`` and
``taskRoles.*.data`` descriptions in openpai-protocol-schema-v2.yaml. Mustache renders an
unknown reference as an empty string, which hides typos until the job misbehaves at run time;
Apiary raises instead.

Reference grammar: ``$root`` followed by any number of ``.key`` (a mapping key, or a list
index when it is all digits) and ``[n]`` (a list index), e.g. ``$parameters.model``,
``$parameters.optim.lr``, ``$data.uri[0]``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from apiary.errors import ValidationError

__all__ = ["TAG_RE", "render", "render_value", "rendered_size", "utf8_size"]

#: One template tag; the body is parsed by :data:`_REF_RE`. Non-greedy so two tags on a line stay two.
TAG_RE = re.compile(r"<%(.*?)%>", re.DOTALL)
#: A tag's body. Matched with ``fullmatch``: ``$`` alone would also match before a trailing newline.
_REF_RE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)((?:\.[A-Za-z0-9_-]+|\[\d+\])*)")
_STEP_RE = re.compile(r"\.([A-Za-z0-9_-]+)|\[(\d+)\]")


def render_value(value: Any) -> str:
    """How a referenced value is written into text.

    Strings as they are; booleans as YAML/JSON writes them (``true``), so a parameter
    ``amp: true`` renders ``true`` rather than Python's ``True``; ``None`` as ``""``; mappings
    and lists as compact JSON; anything else through ``str``.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, Mapping | list | tuple):
        return json.dumps(value, separators=(",", ":"), sort_keys=False, default=str)
    return str(value)


def _lookup(ref: str, root: str, path: str, context: Mapping[str, Any], field: str) -> Any:
    if root not in context:
        known = ", ".join(f"${name}" for name in sorted(context)) or "none"
        raise ValidationError(
            field, f"unknown template reference `{ref}`: `${root}` is not defined here (defined: {known})"
        )
    value: Any = context[root]
    walked = f"${root}"
    for match in _STEP_RE.finditer(path):
        key, index = match.group(1), match.group(2)
        if isinstance(value, Mapping) and key is not None and key in value:
            value = value[key]
        elif isinstance(value, list | tuple) and (index or (key or "")).isdigit():
            i = int(index if index is not None else key)
            if i >= len(value):
                raise ValidationError(
                    field,
                    f"unknown template reference `{ref}`: `{walked}` has {len(value)} item(s), no index {i}",
                )
            value = value[i]
        else:
            step = key if key is not None else f"[{index}]"
            raise ValidationError(field, f"unknown template reference `{ref}`: `{walked}` has no `{step}`")
        walked += match.group(0)
    return value


def render(template: str, context: Mapping[str, Any], field: str) -> str:
    """Replace every ``<% $root.path %>`` tag in ``template`` with its value from ``context``.

    ``context`` maps root names without the ``$`` (``"parameters"``, ``"secrets"``, ``"script"``,
    ...) to plain data (dicts, lists, scalars). ``field`` is the dotted path of the text being
    rendered (``taskRoles.train.commands[0]``) and names it in errors.

    Raises :class:`apiary.errors.ValidationError` (``field`` = the given path) for a tag that is
    not a reference, an undefined root, a missing key or an out-of-range index.
    """

    def replace(match: re.Match[str]) -> str:
        ref = match.group(1).strip()
        parsed = _REF_RE.fullmatch(ref)
        if parsed is None:
            raise ValidationError(
                field,
                f"malformed template tag `{match.group(0)}`: expected "
                "`<% $root.key %>` such as `<% $parameters.model %>`",
            )
        return render_value(_lookup(ref, parsed.group(1), parsed.group(2), context, field))

    return TAG_RE.sub(replace, template)


def utf8_size(text: str) -> int:
    """Bytes of ``text`` encoded as UTF-8 (a lone surrogate counted as the 3 bytes it would take)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def rendered_size(template: str, context: Mapping[str, Any], field: str) -> int:
    """UTF-8 bytes of ``render(template, context, field)``, counted without building the text.

    Each distinct reference is rendered once (its value is held anyway) and counted every time it
    is used, so a 10 KB parameter referenced 1,000 times costs 10 KB here, not the 10 MB the
    rendered text would be. A tag that :func:`render` would refuse (malformed, unknown reference)
    counts as 0 bytes: this answers "how big", :func:`render` answers "is it valid".
    """
    sizes: dict[str, int] = {}
    size = 0
    position = 0
    for match in TAG_RE.finditer(template):
        size += utf8_size(template[position:match.start()])
        position = match.end()
        ref = match.group(1).strip()
        if ref not in sizes:
            parsed = _REF_RE.fullmatch(ref)
            try:
                value = _lookup(ref, parsed.group(1), parsed.group(2), context, field) if parsed else ""
            except ValidationError:
                value = ""
            sizes[ref] = utf8_size(render_value(value))
        size += sizes[ref]
    return size + utf8_size(template[position:])
