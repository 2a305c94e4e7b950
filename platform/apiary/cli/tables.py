"""Lists that fit the terminal without hiding a value: ``apiary job list``, ``node list``, ``cluster status``.

rich shrinks every column of a table that is too wide, so at 80 columns a long job id used to
leave the state column as ``WAIT…``. Here the short columns (a state, a count) are never cut,
the first column (what users copy into the next command) is cut neither, and a trailing
sentence (a waiting reason) takes the width that is left, or moves under the table when that
would be a word a line.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

from apiary.cli.ci import COMPACT, folded, word

#: Narrower than this (characters), a sentence column shows a word or two a line: list it below.
MIN_SENTENCE_WIDTH = 24
#: Narrowest a folded first column gets, however many short columns there are.
MIN_KEY_WIDTH = 8
#: A width no terminal has: to measure a table's natural width.
UNLIMITED = 1 << 16


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
