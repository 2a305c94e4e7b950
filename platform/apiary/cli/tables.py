"""Tables and cells that fit the terminal without hiding a value, for every ``apiary`` command.

:func:`print_rows` prints ``apiary job list``, ``node list``, ``cluster status`` and ``job get``'s
tasks; the column kinds (:func:`uncut`, :func:`folded`, :func:`word`), :data:`COMPACT` and the cell
formats (:func:`short_sha`, :func:`duration`, :func:`when`, :func:`result_text`) serve the other
tables too (``ci runs``, ``deploy history``, ``incident list``).

rich shrinks every column of a table that is too wide, so at 80 columns a long job id used to
leave the state column as ``WAIT…``. Here the short columns (a state, a count) are never cut,
the first column (what users copy into the next command) is cut neither, and a trailing
sentence (a waiting reason) takes the width that is left, or moves under the table when that
would be a word a line.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

SHORT_SHA = 7  # git's default abbreviation
#: Tables of many columns in 80: a rule under the header, no borders (they would take 10 columns).
COMPACT: dict[str, Any] = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "collapse_padding": True}
#: Colours of results and states (CI runs, deployments).
RESULT_STYLES = {"success": "green", "succeeded": "green", "failure": "red", "failed": "red", "error": "red",
                 "rolled_back": "yellow", "running": "cyan"}

#: Narrower than this (characters), a sentence column shows a word or two a line: list it below.
MIN_SENTENCE_WIDTH = 24
#: Narrowest a folded first column gets, however many short columns there are.
MIN_KEY_WIDTH = 8
#: A width no terminal has: to measure a table's natural width.
UNLIMITED = 1 << 16


def uncut(header: str, values: list[str], out: Console) -> Column:
    """A column whose values are never cut (ids, shas): one line while ``out`` has room, folded
    over several lines (every character kept) when a value is wider than the terminal."""
    longest = max((len(v) for v in values), default=len(header))
    room = max(out.width - 4, 1)
    if max(longest, len(header)) <= room:
        return Column(header, no_wrap=True, min_width=max(longest, len(header)))
    return Column(header, overflow="fold", min_width=room)


def folded(header: str, min_width: int | None = None) -> Column:
    """A column that wraps and folds its text rather than cropping it with an ellipsis."""
    return Column(header, overflow="fold", min_width=min_width)


def word(header: str) -> Column:
    """A column of one short word per cell (a state, a duration): kept on one line."""
    return Column(header, no_wrap=True)


def short_sha(sha: str | None) -> str:
    """The first :data:`SHORT_SHA` characters of a commit sha; ``-`` when absent."""
    return (sha or "")[:SHORT_SHA] or "-"


def duration(seconds: float | None) -> str:
    """``12s``, ``3m20s``, ``1h02m``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def when(iso: str | None) -> str:
    """An ISO 8601 UTC time as ``2026-11-25 10:00`` (UTC; a narrow column shows the date over the
    time); ``-`` when absent; the text as given when it is not ISO 8601."""
    if not iso:
        return "-"
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return iso


def result_text(result: str) -> Text:
    """A result or state in its colour (:data:`RESULT_STYLES`; others plain)."""
    return Text(result, style=RESULT_STYLES.get(result, ""))


def _table(key: Column, words: Sequence[str], rows: Sequence[Sequence[str]], sentence: str | None,
           sentences: Sequence[str]) -> Table:
    columns = [key, *(word(h) for h in words)]
    if sentence is not None:
        columns.append(folded(sentence))
    t = Table(*columns, **COMPACT)
    for i, row in enumerate(rows):
        # Text, not str: a value is never read as rich markup ("[x]" in a reason stays as typed).
        cells = [Text(v) for v in row] + ([Text(sentences[i])] if sentence is not None else [])
        t.add_row(*cells)
    return t


def print_rows(out: Console, headers: Sequence[str], rows: Sequence[Sequence[str]], *,
               sentence: str | None = None, sentences: Sequence[str] = (), title: str | None = None) -> None:
    """Print ``rows`` (each ``len(headers)`` strings) under ``headers``, plus a last column
    ``sentence`` holding ``sentences[i]`` for row i, in ``out``'s width.

    Never cut: the first column (one line while it fits beside the others; folded over lines,
    every character kept, when it is wider) and the other ``headers`` (one short word each), as
    long as the short columns and :data:`MIN_KEY_WIDTH` fit the width (below that rich shrinks them).
    The sentence column wraps at words in what width is left; when that is under
    :data:`MIN_SENTENCE_WIDTH` it is printed under the table instead, ``first column: sentence``
    a line, for the rows that have one. ``title``, if given, is a line above. Raises nothing.
    """
    key, words = headers[0], headers[1:]
    whole = Column(key, no_wrap=True)
    # Measured without the terminal's limit (Measurement.get caps at the options' width).
    unlimited = out.options.update_width(UNLIMITED)
    need = Measurement.get(out, unlimited, _table(whole, words, rows, None, sentences)).maximum
    if need > out.width:  # even without the sentence: fold the first column into what is left
        longest = max([len(key), *(len(r[0]) for r in rows)])  # the column's natural width, header included
        room = max(out.width - (need - longest), MIN_KEY_WIDTH)
        key_col, inline = Column(key, overflow="fold", width=room), False
    else:
        key_col = whole
        inline = sentence is not None and out.width - need - 2 >= MIN_SENTENCE_WIDTH  # 2: the gap
    if title is not None:
        out.print(Text(title))
    out.print(_table(key_col, words, rows, sentence if inline else None, sentences))
    below = [(r[0], s) for r, s in zip(rows, sentences, strict=False) if s] if sentence is not None else []
    if below and not inline:
        out.print(Text(f"\n{sentence}:"))
        for first, text in below:
            out.print(Text(f"{first}: {text}"))
