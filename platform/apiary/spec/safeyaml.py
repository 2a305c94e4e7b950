"""Bounded YAML loading for untrusted documents (job specs, cluster configs).

``yaml.safe_load`` constructs no arbitrary objects, but it is not bounded: a few kilobytes of
``[[[[...`` exhaust Python's stack (RecursionError), nine levels of nine aliases ("billion
laughs") expand to 9**9 nodes, and a repeated mapping key silently keeps the last value.
:func:`load` is PyYAML's ``SafeLoader`` with checks made while the node graph is *composed*,
before any Python object is constructed:

* **depth**: collections nested more than ``max_depth`` levels, counted as the constructed data
  will nest (an alias counts as the depth of what it refers to). A flow collection is refused
  as the scanner reads its ``[`` or ``{`` (so ``[`` * 1,000,000 costs about ``max_depth``
  characters of scanning, not the 1,024-character simple-key lookahead per level), everything
  else as the composer opens it;
* **aliases**: more than ``max_aliases`` alias references (``*name``);
* **size**: more than ``max_nodes`` nodes (scalars, sequences, mappings, keys included) with
  every alias counted as the size of the node it refers to, i.e. the size of the data once
  expanded. An alias bomb fails at the alias that crosses the limit, before anything is copied;
* **text reached through aliases**: more than :data:`ALIAS_CHARS_PER_NODE` times ``max_nodes``
  characters of scalars (keys included) counted again for every alias that expands to them. One
  long anchored string aliased a hundred times is few nodes but a hundred copies of the text in
  whatever uses the data (a job's commands go to its node agent in every assignments answer);
* **duplicate keys** in any mapping (YAML 1.2 section 3.2.1.1 requires keys to be unique; PyYAML
  keeps the last). Keys are compared as the Python values they construct to, so ``1`` and
  ``0x1`` collide the way they would in the resulting ``dict``. Merge keys (``<<``) are exempt:
  a mapping's own keys override merged ones (YAML 1.1 merge key spec), which is what they are for;
* **recursive aliases** (``&a [*a]``): a node that contains itself has no finite expansion and
  no JSON form;
* **encoding**: bytes must be UTF-8 (a leading BOM is allowed); PyYAML would also guess UTF-16;
* **scalars that do not fit their tag** (``!!int foo``, the date ``2001-13-45``, an int of more
  than 4,300 digits, Python's int-from-str limit) are YAML errors; ``yaml.safe_load`` lets the
  ValueError (or KeyError, AttributeError) out.

``yaml.CSafeLoader`` composes inside libyaml, where none of these checks can hook in. Where
PyYAML has libyaml, its C parser is used for events only (``_CLoader``): composing, where the
checks sit, and constructing stay PyYAML's Python code, so the checks are exactly those of the
pure-Python loader (``_PyLoader``, the fallback), just faster.

**JSON** (a text whose first character, after white space and a BOM, is ``{`` or ``[``) is read as
JSON first, with ``json.loads``, within the same depth and node limits (JSON has no aliases). JSON is
not quite a subset of YAML 1.1 as PyYAML reads it: an escaped surrogate pair (``"\\ud83d\\ude00"``,
what Python's ``json.dumps`` writes for an emoji) is one character to JSON and an error to PyYAML,
and ``\\/`` is JSON's escaped slash. A text that is not valid JSON (a YAML flow mapping such as
``{a: 1}``, a JSON text with a duplicate key) or that nests past the limit is read as YAML instead,
so its errors are the YAML messages below. A JSON string holding a lone surrogate (``"\\ud800"``),
which no UTF-8 text can carry, is refused.

Every failure, limits and plain syntax errors alike, is an :class:`apiary.errors.ValidationError`
with the caller's ``field`` (``"body"`` for a job spec) and a reason giving the limit and the
1-based line (and column) where it was crossed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.error import Mark
from yaml.events import AliasEvent, ScalarEvent
from yaml.nodes import MappingNode, Node, SequenceNode
from yaml.reader import ReaderError
from yaml.resolver import Resolver

from apiary.errors import ValidationError

__all__ = ["ALIAS_CHARS_PER_NODE", "MAX_ALIASES", "MAX_DEPTH", "MAX_NODES", "load"]

#: Default nesting limit (collections inside collections). Apiary's bound: an OpenPAI job
#: nests about 6 levels (taskRoles.<tr>.resourcePerInstance.ports), a HiveD cluster config about
#: 2 per cell level (physicalCells[].cellChildren[]...), so 64 leaves room for deep ``extras``
#: while staying far from Python's recursion limit (1,000 frames) in whatever walks the data.
MAX_DEPTH = 64
#: Default limit on alias references (``*name``). Apiary's bound: hand-written specs use a
#: handful for shared blocks; ``yaml.safe_dump`` writes one per object shared in the data.
MAX_ALIASES = 100
#: Default limit on nodes after alias expansion. Apiary's bound: a job spec has a few hundred
#: nodes; 100,000 fits a cluster config listing ~10,000 nodes while an alias bomb (9**9 nodes in
#: about 500 bytes) is refused long before it is expanded.
MAX_NODES = 100_000
#: Characters of scalar text that aliases may add, per node of ``max_nodes`` (so 3.2 million for a
#: job spec). Apiary's bound: aliased data may be about as large as a document at the node limit
#: with 32-character scalars, a few times the 1 MiB request body cap and far below what a 900 KB
#: string aliased 99 times makes (89 million characters in every answer that carries the data).
#: The node limit is crossed first by a bomb of short strings ("billion laughs").
ALIAS_CHARS_PER_NODE = 32

_MERGE_TAG = "tag:yaml.org,2002:merge"

# ---- JSON

#: What JSON allows before a value (RFC 8259 section 2), plus the BOM that json.loads refuses.
_JSON_SPACE = " \t\r\n\ufeff"
#: A JSON string (an escape takes the next character whatever it is), a bracket, or a quote that
#: opens no complete string: the rest is then an unterminated string, nothing more to count. The
#: unrolled string pattern fails in one pass, and the lone quote ends the scan, so it stays linear.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|"', re.DOTALL)


class _DuplicateKeyError(ValueError):
    """A JSON object with a key twice (json.loads keeps the last): read as YAML, which names the line."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        raise _DuplicateKeyError
    return data


def json_depth(text: str, limit: int) -> int:
    """How deep ``text``'s JSON arrays and objects nest (0: a scalar), counting brackets outside
    strings with no recursion; stops past ``limit`` (returns ``limit + 1``), so ``[`` * 10**6 costs
    ``limit + 1`` steps. Linear in the length; validates nothing (an unterminated string ends the
    count). Checked before ``json.loads``, whose C scanner recurses once per level (100,000 levels
    raise RecursionError)."""
    depth = deepest = 0
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif token in ("]", "}"):
            depth -= 1
        elif token == '"':
            break
    return deepest


def _check_json(data: Any, *, field: str, what: str, max_nodes: int) -> None:
    """Count the nodes of parsed JSON (as :class:`_Bounds` counts YAML's: keys too) and refuse lone
    surrogates. Iterative (the data may nest up to the depth limit); children are counted as they
    are queued, so a list past the limit is refused before any of it is queued.
    """
    nodes = 1
    # (where, value); where is (parent's where, key or index) or None for the root: a path built
    # only when an error names it
    stack: list[tuple[Any, Any]] = [(None, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, where, field=field, what=what)
        elif isinstance(value, dict | list):
            nodes += len(value) * (2 if isinstance(value, dict) else 1)
            if nodes > max_nodes:
                raise ValidationError(field, f"JSON document has more than {max_nodes} nodes")
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_unicode(key, where, field=field, what=what)
                    stack.append(((where, key), item))
            else:
                stack.extend(((where, i), item) for i, item in enumerate(value))


def _json_path(where: Any) -> str:
    """``taskRoles.train.commands[0]`` from a chain of (parent, key) pairs; "" for the root."""
    steps: list[str | int] = []
    while where is not None:
        where, step = where
        steps.append(step)
    path = ""
    for step in reversed(steps):
        path += f"[{step}]" if isinstance(step, int) else f".{step}" if path else str(step)
    return path


def _check_unicode(text: str, where: Any, *, field: str, what: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        path = _json_path(where)
        at = f" at {path}" if path else ""
        raise ValidationError(
            field, f"{what} is not valid text: a lone surrogate {text[exc.start]!r}{at} (no UTF-8 text holds one)"
        ) from None


def _at(mark: Mark) -> str:
    """``"line L, column C"``, 1-based, of a mark (PyYAML's are 0-based)."""
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _Bounds(Composer, SafeConstructor):
    """PyYAML's composer with :func:`load`'s limits checked as each node is composed.

    Mixed in ahead of a parser (which supplies the events) so that its ``get_single_node`` and
    ``compose_*`` are the ones that run. Raises :class:`ValidationError` from inside PyYAML's
    loading; nothing in PyYAML catches it.
    """

    # Supplied by the parser this is mixed with (yaml.parser.Parser or the C parser).
    check_event: Callable[..., bool]
    peek_event: Callable[[], Any]
    dispose: Callable[[], None]

    def _init_bounds(self, *, field: str, max_depth: int, max_aliases: int, max_nodes: int) -> None:
        self._field = field
        self._max_depth = max_depth
        self._max_aliases = max_aliases
        self._max_nodes = max_nodes
        self._depth = 0  # collections open around the node being composed
        self._deepest = 0  # deepest level reached inside the node being composed, aliases expanded
        self._nodes = 0  # nodes composed so far, each alias counted as its target's size
        self._aliases = 0
        self._sizes: dict[str, int] = {}  # anchor -> nodes in its subtree, aliases expanded
        self._max_alias_chars = ALIAS_CHARS_PER_NODE * max_nodes
        self._chars = 0  # characters of the scalars composed so far, aliases expanded
        self._alias_chars = 0  # of those, the characters aliases added
        self._texts: dict[str, int] = {}  # anchor -> characters of the scalars in its subtree, aliases expanded
        self._heights: dict[str, int] = {}  # anchor -> collection levels in its subtree

    def _fail(self, reason: str) -> ValidationError:
        return ValidationError(self._field, reason)

    def _too_deep(self, mark: Mark) -> ValidationError:
        return self._fail(f"YAML nesting deeper than {self._max_depth} levels at {_at(mark)}")

    def _count(self, nodes: int, mark: Mark) -> None:
        self._nodes += nodes
        if self._nodes > self._max_nodes:
            size = "YAML aliases expand to" if self._aliases else "YAML document has"
            raise self._fail(f"{size} more than {self._max_nodes} nodes at {_at(mark)}")

    # ---- composer: depth, size, aliases, duplicate keys

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            anchor = event.anchor
            if anchor in self.anchors:  # else PyYAML raises "found undefined alias" below
                mark = event.start_mark
                self._aliases += 1
                if self._aliases > self._max_aliases:
                    raise self._fail(f"more than {self._max_aliases} YAML aliases at {_at(mark)}")
                if anchor not in self._sizes:
                    raise self._fail(
                        f"YAML alias *{anchor} at {_at(mark)} refers to a node that contains it "
                        "(recursive structures are not allowed)"
                    )
                reach = self._depth + self._heights[anchor]
                if reach > self._max_depth:
                    raise self._too_deep(mark)
                self._deepest = max(self._deepest, reach)
                self._count(self._sizes[anchor], mark)
                self._chars += self._texts[anchor]
                self._alias_chars += self._texts[anchor]
                if self._alias_chars > self._max_alias_chars:
                    raise self._fail(f"YAML aliases expand to more than {self._max_alias_chars} characters of text "
                                     f"at {_at(mark)}")
            return super().compose_node(parent, index)

        event = self.peek_event()
        anchor = event.anchor
        self._count(1, event.start_mark)
        nodes_before, chars_before, deepest_outside = self._nodes - 1, self._chars, self._deepest
        if isinstance(event, ScalarEvent):
            self._chars += len(event.value)
        self._deepest = self._depth
        node = super().compose_node(parent, index)
        if anchor is not None:  # unique: PyYAML refuses a second "&name" in a document
            self._sizes[anchor] = self._nodes - nodes_before
            self._texts[anchor] = self._chars - chars_before
            self._heights[anchor] = self._deepest - self._depth
        self._deepest = max(self._deepest, deepest_outside)
        return node

    def _enter(self) -> None:
        self._depth += 1
        if self._depth > self._max_depth:
            raise self._too_deep(self.peek_event().start_mark)
        self._deepest = max(self._deepest, self._depth)

    def compose_sequence_node(self, anchor: Any) -> SequenceNode:
        self._enter()
        node = super().compose_sequence_node(anchor)
        self._depth -= 1
        return node

    def compose_mapping_node(self, anchor: Any) -> MappingNode:
        self._enter()
        node = super().compose_mapping_node(anchor)
        self._depth -= 1
        self._check_unique_keys(node)
        return node

    # ---- constructor: a scalar that does not fit its tag is a YAML error, not a crash

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        # SafeConstructor lets Python's own errors out for some scalars: `!!int foo` and a
        # 5,000-digit int (ValueError; Python's int-from-str digit limit), `!!bool x`
        # (KeyError), `!!timestamp x` (AttributeError), the implicit timestamp 2001-13-45
        # (ValueError). Innermost call first, so the mark is the scalar's.
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as exc:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise ConstructorError(
                None, None, f"value is no valid {tag} ({type(exc).__name__}: {exc})", node.start_mark
            ) from None

    def _check_unique_keys(self, node: MappingNode) -> None:
        # Keys are constructed (scalars only: cheap, and cached for the real construction) so
        # that equal Python keys collide exactly as they would in the dict. A collection as a
        # key is unhashable; the constructor refuses it later.
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or isinstance(key_node, SequenceNode | MappingNode):
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise self._fail(f"duplicate key {key!r} at line {line} (first at line {first_line[key]})")
            first_line[key] = line


class _PyLoader(_Bounds, yaml.SafeLoader):
    """The bounds over PyYAML's pure-Python scanner and parser (used where libyaml is missing)."""

    def __init__(self, stream: str, *, field: str, max_depth: int, max_aliases: int, max_nodes: int) -> None:
        yaml.SafeLoader.__init__(self, stream)
        self._init_bounds(field=field, max_depth=max_depth, max_aliases=max_aliases, max_nodes=max_nodes)

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:  # noqa: N803 (PyYAML's name)
        # Each open '[' or '{' is a possible simple key the scanner keeps for up to 1,024
        # characters and re-checks on every token: quadratic on '[' * 10**6 before the composer
        # sees the second level. Flow nesting never exceeds node nesting, so refusing here is
        # never stricter than the composer's check.
        if self.flow_level >= self._max_depth:
            raise self._too_deep(self.get_mark())
        super().fetch_flow_collection_start(TokenClass)


#: The loader :func:`load` uses: libyaml's parser where PyYAML was built with it.
_Loader: Callable[..., _Bounds] = _PyLoader

if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class _CLoader(_Bounds, CParser, Resolver):
        """The bounds over libyaml's scanner and parser, which only deliver events here.

        Composition (where every check sits) and construction stay PyYAML's Python code, so the
        checks are the same as :class:`_PyLoader`'s; parsing in C makes a document at the node
        limit load about 6x faster (100,000 nodes: 0.6 s instead of 3.7 s, measured). libyaml's
        simple-key lookahead is bounded (1,024 characters) and cheap in C, so deep flow nesting
        needs no scanner hook.
        """

        def __init__(self, stream: str, *, field: str, max_depth: int, max_aliases: int, max_nodes: int) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            self._init_bounds(field=field, max_depth=max_depth, max_aliases=max_aliases, max_nodes=max_nodes)

    _Loader = _CLoader


def load(
    text: str | bytes,
    *,
    field: str = "body",
    what: str = "document",
    max_depth: int = MAX_DEPTH,
    max_aliases: int = MAX_ALIASES,
    max_nodes: int = MAX_NODES,
) -> Any:
    """Parse one YAML document (JSON is YAML) from untrusted ``text`` into plain data.

    Returns what ``yaml.safe_load`` returns for the same document (None for an empty one) when
    it is within the limits (see the module docstring; defaults :data:`MAX_DEPTH`,
    :data:`MAX_ALIASES`, :data:`MAX_NODES`). A JSON text is read as JSON (``json.loads``: escaped
    surrogate pairs are one character; ``NaN`` and ``Infinity`` stay the strings YAML makes of
    them) within the same depth and node limits.

    Raises :class:`apiary.errors.ValidationError` with ``field`` and nothing else for bad input:
    ``"<what> is not UTF-8 text: ..."`` for undecodable bytes, ``"<what> is not valid YAML at line
    L, column C: <problem>"`` for a syntax error, and a reason naming the limit (``"YAML nesting
    deeper than 64 levels at line 1, column 65"``, ``"YAML aliases expand to more than 100000
    nodes at ..."``, ``"YAML aliases expand to more than 3200000 characters of text at ..."``,
    ``"more than 100 YAML aliases at ..."``, ``"duplicate key 'name' at line 3 (first at line 2)"``)
    for a document outside them; for JSON, ``"JSON document has more than 100000 nodes"`` and
    ``"<what> is not valid text: a lone surrogate '\\ud800' at <path>"``.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValidationError(field, f"{what} is not UTF-8 text: {exc}") from None
    json_text = text.lstrip(_JSON_SPACE)
    if json_text[:1] in ("{", "[") and json_depth(json_text, max_depth) <= max_depth:
        try:
            data = json.loads(json_text, object_pairs_hook=_unique_pairs, parse_constant=str)
        except ValueError:  # JSONDecodeError, a duplicate key, an int past 4,300 digits: read as YAML
            pass
        else:
            _check_json(data, field=field, what=what, max_nodes=max_nodes)
            return data
    try:
        # Inside the try: the reader already refuses characters YAML does not allow, and the C
        # parser encodes str to UTF-8, which fails on a lone surrogate ("\ud800").
        loader = _Loader(text, field=field, max_depth=max_depth, max_aliases=max_aliases, max_nodes=max_nodes)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at {_at(mark)}" if mark is not None else ""
        problem = ", ".join(part for part in (exc.context, exc.problem) if part) or str(exc)
        raise ValidationError(field, f"{what} is not valid YAML{where}: {problem}") from None
    except ReaderError as exc:
        raise ValidationError(field, f"{what} is not valid YAML: {exc.reason} (at position {exc.position})") from None
    except UnicodeEncodeError as exc:
        raise ValidationError(field, f"{what} is not valid text: {exc.reason} (at position {exc.start})") from None
