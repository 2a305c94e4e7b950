"""Short cyclic-GC pauses in a process that holds a large, long-lived scheduler state.

Why: CPython 3.11's cyclic collector is generational and not incremental; a full (generation-2)
collection traverses every tracked object. At 10,000 nodes the scheduler's cell tree, segments and
running groups are about 800,000 objects, and one full collection took 450 ms on the reference
machine (``bench/scheduler.py`` at 10,000 nodes, 2026-11-23), stalling whatever scheduling decision
or API request was running. Almost all of those objects live as long as the process.

The policy (:func:`install`):

* after every full collection its survivors are frozen (``gc.freeze``): they outlived a full
  collection, so later ones traverse only the objects born since;
* full collections come sooner (thresholds :data:`THRESHOLDS`), so each of them sees few objects
  (measured at 10,000 nodes: longest pause 7 ms instead of 450 ms);
* frozen objects that later die are freed by reference counting as usual; only cycles that die
  while frozen wait. When the heap (``sys.getallocatedblocks``: a walk over the allocator's arenas,
  ~0.4 ms for 6 million blocks; ``gc.get_freeze_count`` walks every frozen object, 20 ms for 2
  million) has grown to :data:`RECLAIM_GROWTH` times its size after the last whole-heap
  collection, it is unfrozen and the next full collection sees everything again: one long pause
  per doubling of the heap, the same amortization CPython uses for its own full collections (it
  waits for 25 % growth).

:func:`settle` collects and freezes the whole heap; the control plane calls it where a pause is
expected anyway (the scheduler rebuilt from the store at start, a cluster reconfiguration). Both
are process-wide: the control-plane process (:func:`apiary.wiring.serve`), ``apiary hollow-nodes``
(thousands of agents in one process) and the scheduler benchmark install the policy; library
users and tests that embed a plane do not, and :func:`settle` does nothing in a process that did
not :func:`install`.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

# gen0 every 700 allocations (CPython's default), gen1 every 5 gen0, gen2 at every gen1 collection
# once enough has survived (CPython's defaults are (700, 10, 10)); tuned on bench/scheduler.py at
# 10,000 nodes: (700, 10, 2) gave a 14 ms longest pause, (700, 5, 1) 7 ms, same throughput.
THRESHOLDS = (700, 5, 1)
RECLAIM_GROWTH = 2.0


class _State:
    installed = False
    saved_thresholds: tuple[int, int, int] = (700, 10, 10)
    baseline = 0  # allocated blocks after the last whole-heap collection
    reclaiming = False  # the heap was unfrozen: the next full collection sees all of it
    full_collections = 0
    reclaims = 0


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase != "stop" or info.get("generation") != 2:
        return
    _State.full_collections += 1
    gc.freeze()
    if _State.reclaiming:
        _State.reclaiming = False
        _State.baseline = sys.getallocatedblocks()
    elif sys.getallocatedblocks() > RECLAIM_GROWTH * max(_State.baseline, 1):
        gc.unfreeze()
        _State.reclaiming = True
        _State.reclaims += 1


def install() -> None:
    """Install the policy in this process (idempotent). Not thread-safe against a concurrent
    :func:`uninstall`; call it once at process start."""
    if _State.installed:
        return
    _State.saved_thresholds = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    gc.callbacks.append(_on_gc)
    _State.installed = True
    settle()


def uninstall() -> None:
    """Undo :func:`install`: previous thresholds, nothing frozen (idempotent)."""
    if not _State.installed:
        return
    gc.callbacks.remove(_on_gc)
    gc.set_threshold(*_State.saved_thresholds)
    gc.unfreeze()
    _State.installed = False
    _State.reclaiming = False
    _State.baseline = 0


def settle() -> None:
    """Collect the whole heap, then freeze the survivors (blocking; as long as one full collection
    of everything: ~0.5 s at 10,000 nodes). A no-op unless :func:`install` was called."""
    if not _State.installed:
        return
    gc.unfreeze()
    _State.reclaiming = True  # the collection below sees everything; _on_gc resets the baseline
    gc.collect()
    if _State.reclaiming:  # gc.collect ran with collection disabled elsewhere: no callback
        _State.reclaiming = False
        gc.freeze()
        _State.baseline = sys.getallocatedblocks()
    # CPython defers a full collection until the objects promoted since the last one exceed a
    # quarter of what that one left in generation 2: everything, before the freeze. One more
    # collection of the (now empty) heap resets that count, else the first full collection after
    # a settle waits for a quarter of the heap to be born and takes ~100 ms at 10,000 nodes.
    gc.collect()


def stats() -> dict[str, int]:
    """``{"installed": 0|1, "frozen": objects, "full_collections": n, "reclaims": n}`` since install
    (walks every frozen object: ~10 ms per million; for diagnostics, not a hot path)."""
    return {
        "installed": int(_State.installed),
        "frozen": gc.get_freeze_count(),
        "full_collections": _State.full_collections,
        "reclaims": _State.reclaims,
    }
