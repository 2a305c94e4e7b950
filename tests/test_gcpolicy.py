"""apiary.gcpolicy: full collections freeze their survivors; cycles that die frozen are reclaimed
when the heap grows; settle does nothing unless installed. Pause lengths are a benchmark's matter
(bench/scheduler.py reports gc_max_pause_ms), not asserted here."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from apiary import gcpolicy


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _tracked_young() -> set[int]:
    return {id(o) for g in range(3) for o in gc.get_objects(generation=g)}


@pytest.fixture
def policy() -> Iterator[None]:
    before = gc.get_threshold()
    gcpolicy.install()
    try:
        yield
    finally:
        gcpolicy.uninstall()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_settle_is_a_no_op_without_install() -> None:
    assert gc.get_freeze_count() == 0
    gcpolicy.settle()
    assert gc.get_freeze_count() == 0


def test_install_freezes_the_heap_and_sets_thresholds(policy: None) -> None:
    assert gc.get_threshold() == gcpolicy.THRESHOLDS
    assert gc.get_freeze_count() > 1000  # the interpreter and pytest at least


def test_a_full_collection_freezes_its_survivors(policy: None) -> None:
    keep = _Node()
    assert id(keep) in _tracked_young()
    gc.collect()
    assert id(keep) not in _tracked_young()  # frozen: later full collections skip it


def test_garbage_cycles_still_die_when_young(policy: None) -> None:
    ref = _cycle()
    gc.collect()
    assert ref() is None


def test_a_cycle_that_dies_frozen_waits_for_the_heap_to_grow(
    policy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = [_Node()]
    holder[0].other = holder[0]  # a self-cycle, alive for now
    ref = weakref.ref(holder[0])
    gc.collect()  # survives: frozen
    holder.clear()  # now cyclic garbage, but frozen
    gc.collect()
    assert ref() is not None  # not reclaimed while the heap has not grown
    monkeypatch.setattr(gcpolicy, "RECLAIM_GROWTH", 0.0)  # "the heap has grown": every collection
    gc.collect()  # this one sees the growth and unfreezes
    monkeypatch.setattr(gcpolicy, "RECLAIM_GROWTH", 2.0)
    gc.collect()  # the whole heap: the cycle is collected
    assert ref() is None
    assert gcpolicy.stats()["reclaims"] >= 1


def test_settle_collects_frozen_garbage(policy: None) -> None:
    holder = [_Node()]
    holder[0].other = holder[0]
    ref = weakref.ref(holder[0])
    gc.collect()
    holder.clear()
    gcpolicy.settle()
    assert ref() is None
    assert gc.get_freeze_count() > 0
