"""HiveD's own algorithm tests, replayed against HivedScheduler on HiveD's design config.

Source: microsoft/hivedscheduler, ``pkg/algorithm/hived_algorithm_test.go`` (the version with
testBadNodes and testSafeRelaxedBuddyAlloc, whose pod specs say SkuType/SkuNumber where older ones say
GpuType/GpuNumber), run on ``example/config/design/hivedscheduler.yaml``, committed unmodified as
``hived_design/hivedscheduler.yaml`` (see ``hived_design/README.md``).  The cases are written anew from
what those tests do and expect.

Translation:

* HiveD schedules one pod at a time; Apiary one affinity group at a time.  A HiveD group's pods are the
  instances of one task role ``pod`` (one role per member where members differ: group9 has ``a``, 7 GPUs,
  and ``b``, 5 GPUs), so pod5 and pod6 are one step, checked on one decision.  SkuType is ``sku_type``
  ("" = None), SkuNumber ``gpu``, PinnedCellId ``pinned_cell_id``, priority -1 opportunistic,
  LazyPreemptionEnable ``GroupRequest.lazy_preemption``; every HiveD group is a gang.
* A bind info (node, GPU isolation) is a TaskPlacement (node, gpus).  Apiary lists GPUs sorted, HiveD in
  cell order, so GPUs compare as sets.  PodPreemptInfo is a ``preempt`` decision whose victims are
  groups; no bind info (PodWaitInfo) is ``wait``; a User Error panic is ValidationError from
  ``validate`` and ``schedule``.
* AddAllocatedPod is ``allocate``, DeleteAllocatedPod ``release``, DeleteUnallocatedPod of a preempting
  pod ``cancel``, setBadNode / setHealthyNode ``set_node_health``.  A group HiveD reports preempting is
  one with an entry in ``status()["reservations"]``; a lazy-preempted one (virtual placement nil) has
  ``status()["groups"][g]["downgraded"]``; a VC's virtual cells HiveD marks bad (doomed: only bad
  hardware is left for them) are counted in ``status()["virtualClusters"][vc]["doomedBadCells"]``.
* Suggested nodes (the candidate list of the Kubernetes scheduler) have no equivalent; node health is the
  nearest: :func:`suggested` marks every other node unhealthy for the one call and restores it after.
  HiveD's Filtering phase has no equivalent at all.
* HiveD's reconfiguration (a new HivedAlgorithm, then AddAllocatedPod of every pod) is ``reconfigure``.

Each step of a HiveD test is one case: it replays the steps before it on a fresh scheduler, then acts
and checks what HiveD expects; ``check_invariants`` runs after every step.  A scheduling step commits the
bind infos HiveD expects (what HiveD's test hands to AddAllocatedPod), so every step starts from HiveD's
state and a tie at one step does not move the next.  Where HiveD picks one of equivalent cells (two
interchangeable nodes or racks, or a chain: HiveD's test sorts its chains to make the pick stable) the
case asserts the property that matters and says so.  Every expectation holds; a disagreement would be
marked ``xfail(strict=True)`` with its reason (the README's "Deliberate differences from HiveD" lists
the differences by design).  What cannot be expressed is a comment, not a case.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from apiary.errors import ValidationError
from apiary.scheduler import Decision, GroupRequest, HivedScheduler, TaskPlacement, TaskRequest
from apiary.spec.cluster import ClusterConfig

DESIGN = Path(__file__).resolve().parent / "hived_design" / "hivedscheduler.yaml"
DESIGN_TEXT = DESIGN.read_text(encoding="utf-8")

DGX2, P100, CT1 = "DGX2-V100", "DGX1-P100", "CT1"
PIN = "VC1-YQW-DGX2"  # VC1's pinned rack: nodes 0.0.3.0 and 0.0.3.1
OPPO = -1
ALL16 = tuple(range(16))
PINNED_NODES = {"0.0.3.0", "0.0.3.1"}
DGX2_NODES = {"0.0.1.0", "0.0.5.0", "0.0.2.0", "0.0.2.1", "0.0.2.2", *PINNED_NODES, "0.0.3.2", "0.0.3.3"} | {
    f"0.0.4.{i}" for i in range(4)
}
#: the lowest cells above node level (3-DGX2-V100-NODE, 2-DGX2-V100-NODE): a gang kept in one is in one rack
RACKS = [{"0.0.2.0", "0.0.2.1", "0.0.2.2"}, PINNED_NODES, {"0.0.3.2", "0.0.3.3"}, {"0.0.4.0", "0.0.4.1"}]
RACKS += [{"0.0.4.2", "0.0.4.3"}]
#: GPUs of the DGX1-P100 nodes in the config's cell order (1.0.0.0 lists sockets and switches out of order)
CELL_ORDER = {"1.0.0.0": (1, 3, 4, 7, 0, 2, 6, 5), "1.0.0.1": tuple(range(8)), "1.0.0.2": tuple(range(8))}

# A HiveD bind info: (task role, node, GPUs)
Pod = tuple[str, str, Sequence[int]]
Act = Callable[[HivedScheduler], Decision | None]
Check = Callable[[HivedScheduler, Decision | None], None]


# ---------------------------------------------------------------------------------------------- builders
def design(edit: Callable[[dict[str, Any]], None] | None = None) -> ClusterConfig:
    """HiveD's design config, changed by ``edit`` (on the parsed YAML) where a HiveD test changes it."""
    raw = yaml.safe_load(DESIGN_TEXT)
    if edit is not None:
        edit(raw)
    return ClusterConfig.from_dict(raw)


def group(name: str, vc: str, priority: int, *tasks: TaskRequest, lazy: bool = True) -> GroupRequest:
    return GroupRequest(name, vc, priority, True, tasks, lazy_preemption=lazy)


def pods(n: int, gpus: int, sku: str | None = DGX2, pin: str | None = None, role: str = "pod") -> TaskRequest:
    return TaskRequest(role, n, gpus, 0.0, 0, sku_type=sku, pinned_cell_id=pin)


def bind_infos(pods_: Sequence[Pod]) -> list[TaskPlacement]:
    """HiveD's bind infos as placements (every leaf cell of this config is one GPU: leaf index = GPU)."""
    out, seen = [], {}
    for role, node, gpus in pods_:
        seen[role] = seen.get(role, -1) + 1
        out.append(TaskPlacement(role, seen[role], node, tuple(sorted(gpus)), tuple(sorted(gpus))))
    return out


@contextmanager
def suggested(s: HivedScheduler, nodes: Sequence[str] | None) -> Iterator[None]:
    """HiveD's suggested nodes, approximated by node health: every other healthy node is unhealthy for
    the duration (None: all nodes)."""
    off = [] if nodes is None else [n for n, row in s.status()["nodes"].items() if row["healthy"] and n not in nodes]
    for n in off:
        s.set_node_health(n, False)
    try:
        yield
    finally:
        for n in off:
            s.set_node_health(n, True)


# ------------------------------------------------------------------------------------------------- steps
@dataclass(frozen=True)
class Step:
    """One action of a HiveD test and the expectation HiveD checks right after it."""

    id: str
    act: Act
    check: Check
    xfail: str | None = None  # why Apiary disagrees with HiveD here
    raises: type[Exception] | None = None  # the only failure the xfail allows (None: any)
    replayed: bool = True  # False: later steps replay without it (see where it is used)


def ask(
    request: GroupRequest, hived: Sequence[Pod] | None = None, on: Sequence[str] | None = None, commit: bool = True
) -> Act:
    """Schedule ``request`` (suggested nodes ``on``), then commit (AddAllocatedPod) HiveD's bind infos
    ``hived`` when given, else Apiary's placement when it places; ``commit=False``: HiveD's test only asks."""

    def act(s: HivedScheduler) -> Decision:
        with suggested(s, on):
            d = s.schedule(request)
        if commit and hived is not None:
            s.allocate(request.name, request, bind_infos(hived))
        elif commit and d.kind == "place":
            s.allocate(request.name, request, d.placements)
        return d

    return act


def then(*actions: Callable[[HivedScheduler], Any]) -> Act:
    """Actions in order; the step's decision is the last one's."""

    def act(s: HivedScheduler) -> Decision | None:
        d = None
        for a in actions:
            d = a(s)
        return d if isinstance(d, Decision) else None

    return act


def nothing(s: HivedScheduler) -> None:
    """A step that only checks the state the previous step left."""


def cases(steps: Sequence[Step]) -> list[Any]:
    return [
        pytest.param(
            steps,
            k,
            id=st.id,
            marks=[pytest.mark.xfail(strict=True, reason=st.xfail, raises=st.raises)] if st.xfail else [],
        )
        for k, st in enumerate(steps)
    ]


def replay(s: HivedScheduler, steps: Sequence[Step], k: int) -> None:
    for st in steps[:k]:
        if st.replayed:
            st.act(s)
            s.check_invariants()
    d = steps[k].act(s)
    steps[k].check(s, d)
    s.check_invariants()


# ------------------------------------------------------------------------------------------------ checks
def placements(d: Decision | None) -> tuple[TaskPlacement, ...]:
    assert d is not None and d.kind == "place", d
    return d.placements


def placed(*expected: Pod) -> Check:
    """HiveD's bind infos, literally (instances of one role are interchangeable; GPUs compare as sets)."""

    def check(s: HivedScheduler, d: Decision | None) -> None:
        got = sorted((p.task_role, p.node, tuple(sorted(p.gpus))) for p in placements(d))
        assert got == sorted((r, n, tuple(sorted(g))) for r, n, g in expected)

    return check


def waits(s: HivedScheduler, d: Decision | None) -> None:
    assert d is not None and d.kind == "wait", d


def preempts(*victims: str) -> Check:
    def check(s: HivedScheduler, d: Decision | None) -> None:
        assert d is not None and d.kind == "preempt", d
        assert set(d.victims) == set(victims)

    return check


def whole_nodes_in_one_rack(n: int) -> Check:
    """``n`` whole DGX2-V100 nodes (no other group can share them) inside one rack: their lowest common
    ancestor is a cell right above node level."""

    def check(s: HivedScheduler, d: Decision | None) -> None:
        nodes = {p.node for p in placements(d)}
        assert len(nodes) == n and all(p.gpus == ALL16 for p in placements(d))
        assert any(nodes <= rack for rack in RACKS), nodes

    return check


def reservation_nodes(s: HivedScheduler, name: str) -> set[str]:
    return {c.split("/")[0] for c in s.status()["reservations"][name]["cells"]}


# ------------------------------------------------------------------------------- testNormalOperations
def any_vc1_node_gpu0(s: HivedScheduler, d: Decision | None) -> None:
    """Tie (chain order): VC1 has DGX2-V100 node cells in three chains and HiveD's test sorts its chains
    so that DGX2-V100-NODE comes first (0.0.1.0).  GPU 0 of any of VC1's unpinned DGX2 nodes is the same."""
    (p,) = placements(d)
    assert p.node in DGX2_NODES - PINNED_NODES and p.gpus == (0,)


def opportunistic_gpu0_away_from_guaranteed(s: HivedScheduler, d: Decision | None) -> None:
    """Tie (chain order): HiveD puts the opportunistic pod on 0.0.5.0, the first free node of its first
    chain; what HiveD means by it is GPU 0 of an unpinned node no other group uses (not 0.0.1.0, where
    pod1-pod3 run)."""
    (p,) = placements(d)
    assert p.node in DGX2_NODES - PINNED_NODES and p.gpus == (0,)
    assert set(s.status()["nodes"][p.node]["used"]) == {"group4"}  # checked after the commit


def two_p100_nodes_packed(s: HivedScheduler, d: Decision | None) -> None:
    """Tie: VC2's two DGX1-P100-NODE cells may bind to any two nodes of the 3-node rack (HiveD: 1.0.0.0 for
    pod8, 1.0.0.2 for pod9).  On its node each pod gets the first GPUs in the config's cell order, as
    HiveD gives (pod8 on 1.0.0.0: 1, 3, 4, 7, the whole of socket 1, then 0, 2, 6)."""
    by_role = {p.task_role: p for p in placements(d)}
    assert by_role["a"].node != by_role["b"].node
    for role, n in (("a", 7), ("b", 5)):
        p = by_role[role]
        assert set(p.gpus) == set(CELL_ORDER[p.node][:n]), p


def preempts_group5_twice(s: HivedScheduler, d: Decision | None) -> None:
    """pod16 and pod17 are group11's two pods: HiveD answers each with victims pod5 and pod6 (group5);
    Apiary answers the group, and again the same when asked twice (a reservation is kept, not remade)."""
    preempts("group5")(s, d)
    preempts("group5")(s, s.schedule(G11))


def a_ct1_node_without_the_pinned_gpu(s: HivedScheduler, d: Decision | None) -> None:
    """Tie: VC2's CT1-NODE cell binds to 0.0.0.0 or 0.0.0.1 (1.0.0.2 holds VC1's pinned CT1 GPU and cannot
    be a whole VC2 cell); HiveD picks 0.0.0.1."""
    (p,) = placements(d)
    assert p.node in {"0.0.0.0", "0.0.0.1"} and p.gpus == (0, 1)


def lazily_preempts_pod24(s: HivedScheduler, d: Decision | None) -> None:
    """pod25 (priority 1) needs VC2's only CT1-NODE cell, used by pod24 (priority 0, lazy preemption on):
    pod24 runs on as opportunistic on 0.0.0.1 and pod25 gets the cell rebound to 0.0.0.0."""
    placed(("pod", "0.0.0.0", (0, 1)))(s, d)
    assert d is not None and d.downgraded == ("group15",) and d.victims == ()


G11 = group("group11", "VC1", 2, pods(2, 16, pin=PIN))
G15 = group("group15", "VC2", 0, pods(1, 2, sku=CT1))

NORMAL = [
    Step("pod1-one-gpu", ask(group("group1", "VC1", 0, pods(1, 1)), [("pod", "0.0.1.0", [0])]), any_vc1_node_gpu0),
    Step(
        "pod2-buddy-of-pod1",
        ask(group("group2", "VC1", 1, pods(1, 1)), [("pod", "0.0.1.0", [1])]),
        placed(("pod", "0.0.1.0", [1])),
    ),
    Step(
        "pod3-other-half-of-the-node",
        ask(group("group3", "VC1", 2, pods(1, 8)), [("pod", "0.0.1.0", range(8, 16))]),
        placed(("pod", "0.0.1.0", range(8, 16))),
    ),
    Step(
        "pod4-opportunistic-away-from-guaranteed",
        ask(group("group4", "VC1", OPPO, pods(1, 1)), [("pod", "0.0.5.0", [0])]),
        opportunistic_gpu0_away_from_guaranteed,
    ),
    Step(
        "pod5+pod6-pinned-cell",
        ask(group("group5", "VC1", 1, pods(2, 16, pin=PIN)), [("pod", "0.0.3.0", ALL16), ("pod", "0.0.3.1", ALL16)]),
        placed(("pod", "0.0.3.0", ALL16), ("pod", "0.0.3.1", ALL16)),
    ),
    Step("pod7-insufficient-vc-cells-waits", ask(group("group7", "VC2", 1, pods(3, 8, sku=P100))), waits),
    Step(
        "pod8+pod9-any-sku-heterogeneous-group",
        ask(
            group("group9", "VC2", 1, pods(1, 7, sku=None, role="a"), pods(1, 5, sku=None, role="b")),
            [("a", "1.0.0.0", (1, 3, 4, 7, 0, 2, 6)), ("b", "1.0.0.2", range(5))],
        ),
        two_p100_nodes_packed,
    ),
    # group5 runs on the pinned cell: it is named a victim and stopped, not downgraded (a pinned cell
    # cannot hold opportunistic work).
    Step("pod16+pod17-preempt-the-pinned-cell", ask(G11), preempts_group5_twice),
    Step(
        "pod18+pod19-gang-in-one-rack",
        ask(group("group12", "VC1", 1, pods(2, 16)), [("pod", "0.0.3.2", ALL16), ("pod", "0.0.3.3", ALL16)]),
        # Tie: HiveD takes 0.0.3.2 and 0.0.3.3; any two of VC1's free node cells in one rack are as good.
        whole_nodes_in_one_rack(2),
    ),
    Step(
        "pod20+pod21-gang-in-one-rack",
        ask(group("group13", "VC1", 1, pods(2, 16)), [("pod", "0.0.4.0", ALL16), ("pod", "0.0.4.1", ALL16)]),
        # Tie (chain order): HiveD takes 0.0.4.0 and 0.0.4.1 in the 4-DGX2 chain; VC1's two node cells in the
        # 3-DGX2 chain (one rack) are as good.
        whole_nodes_in_one_rack(2),
    ),
    Step(
        "pod22+pod23-opportunistic-gang",
        ask(group("group14", "VC1", OPPO, pods(2, 16)), [("pod", "0.0.4.2", ALL16), ("pod", "0.0.4.3", ALL16)]),
        # Tie (chain order): HiveD takes 0.0.4.2 and 0.0.4.3; two free nodes of the free 3-DGX2 rack are as good.
        whole_nodes_in_one_rack(2),
    ),
    Step("pod24-ct1", ask(G15, [("pod", "0.0.0.1", (0, 1))]), a_ct1_node_without_the_pinned_gpu),
    Step(
        "pod25-lazily-preempts-pod24",
        ask(group("group16", "VC2", 1, pods(1, 2, sku=CT1), lazy=False), [("pod", "0.0.0.0", (0, 1))]),
        lazily_preempts_pod24,
    ),
]
# HiveD's pod26 (priority 2, "will preempt pod25 immediately") is declared with an expected victim but
# never scheduled by any HiveD test, so it is not replayed here.


@pytest.mark.parametrize(("steps", "k"), cases(NORMAL))
def test_normal_operations(steps: list[Step], k: int) -> None:
    replay(HivedScheduler(design()), steps, k)


@pytest.mark.parametrize(
    "request_",
    [
        pytest.param(group("group6", "VC2", 1, pods(1, 1, sku=DGX2)), id="pod10-sku-the-vc-does-not-have"),
        pytest.param(group("group10", "surprise!", 1, pods(1, 1, sku=P100)), id="pod13-unknown-vc"),
        pytest.param(group("group10", "VC2", 1, pods(1, 1, sku=P100, pin="surprise!")), id="pod14-unknown-pinned-cell"),
        pytest.param(group("group10", "VC2", 1001, pods(1, 1, sku=P100)), id="pod15-priority-1001"),
    ],
)
def test_normal_operations_user_errors(request_: GroupRequest) -> None:
    """HiveD panics with a User Error; Apiary rejects the request at validate and schedule.  HiveD asks
    after the normal operations; Apiary's checks do not depend on the state, so a fresh scheduler.

    Not expressible: pod11 and pod12 (one pod asking 2 GPUs in group8, whose only member asks 8): a
    GroupRequest is the group itself, so a pod cannot disagree with its group."""
    s = HivedScheduler(design())
    with pytest.raises(ValidationError):
        s.validate(request_)
    with pytest.raises(ValidationError):
        s.schedule(request_)
    s.check_invariants()


def test_normal_operations_deleting_every_pod_leaves_no_group() -> None:
    """testDeletePods: delete the allocated pods in reverse order, then the preempting ones (group11's):
    no group is left, allocated or preempting.  Invariants are checked once everything is deleted: before,
    group5 runs downgraded on pinned cells (the pod16+pod17 case)."""
    s = HivedScheduler(design())
    for st in NORMAL:
        st.act(s)
    assert list(s.groups()) == [f"group{i}" for i in (1, 2, 3, 4, 5, 9, 12, 13, 14, 15, 16)]
    assert set(s.status()["reservations"]) == {"group11"}
    for name in reversed(list(s.groups())):
        s.release(name)
    s.cancel("group11")
    assert s.groups() == {} and s.status()["reservations"] == {}
    s.check_invariants()


# ----------------------------------------------------------------------------------- testSuggestedNodes
ALL_BUT_0031 = sorted(DGX2_NODES - {"0.0.3.1"})  # other SKUs' nodes do not matter to DGX2-V100 pods
G18 = group("group18", "VC1", 1, pods(2, 16, pin=PIN), lazy=False)
G24 = group("group24", "VC1", 3, pods(2, 16, pin=PIN))


def preempting(name: str, *victims: str) -> Check:
    def check(s: HivedScheduler, d: Decision | None) -> None:
        preempts(*victims)(s, d)
        assert name in s.status()["reservations"]

    return check


def not_preempting(name: str) -> Check:
    def check(s: HivedScheduler, d: Decision | None) -> None:
        waits(s, d)
        assert name not in s.status()["reservations"] and name not in s.groups()

    return check


SUGGESTED = [
    Step(
        "pod36-any-sku-opportunistic-within-suggested",
        ask(group("group1", "VC1", OPPO, pods(1, 1, sku=None)), on=["0.0.1.0"], commit=False),
        placed(("pod", "0.0.1.0", [0])),
    ),
    Step(
        "pod37-pinned-within-suggested",
        ask(group("group1", "VC1", 1, pods(1, 1, pin=PIN)), [("pod", "0.0.3.0", [0])], on=["0.0.3.0"]),
        placed(("pod", "0.0.3.0", [0])),
    ),
    Step(
        "pod38-pinned-away-from-its-buddy-within-suggested",
        ask(group("group2", "VC1", 1, pods(1, 1, pin=PIN)), on=["0.0.3.1"], commit=False),
        placed(("pod", "0.0.3.1", [0])),
    ),
    Step(
        "pod27-placement-outside-suggested-waits",
        then(lambda s: s.release("group1"), ask(G18, on=ALL_BUT_0031)),
        waits,
    ),
    Step(
        "pod27-all-suggested-is-placed",
        ask(G18, [("pod", "0.0.3.0", ALL16), ("pod", "0.0.3.1", ALL16)]),
        placed(("pod", "0.0.3.0", ALL16), ("pod", "0.0.3.1", ALL16)),
    ),
    # Not expressible: pod33 in HiveD's Filtering phase (no preemption there; Apiary has no phases).
    Step("pod33-preemption-outside-suggested-not-started", ask(G24, on=ALL_BUT_0031), not_preempting("group24")),
    Step("pod33-all-suggested-preempts", ask(G24), preempting("group24", "group18")),
    Step(
        "pod33-placement-no-longer-suggested-cancels",
        ask(G24, on=ALL_BUT_0031),
        # HiveD deletes the preempting group24 once its placement (0.0.3.0, 0.0.3.1) is no longer within
        # the suggested nodes; Apiary drops a reservation whose cells' node went bad, and plans afresh.
        not_preempting("group24"),
    ),
]


def backtracking_config(raw: dict[str, Any]) -> None:
    """VC1 without its two 4-DGX2.2-DGX2.DGX2-V100-NODE cells, with three 2-node cells instead of one."""
    vc1 = raw["virtualClusters"]["VC1"]["virtualCells"]
    vc1[0]["cellNumber"] = 0
    vc1[3]["cellNumber"] = 3


def still_allocated(name: str) -> Check:
    """pod41 (4 pods, 3 suggested nodes) cannot be placed: it waits, and ``name`` stays allocated, not lazily
    preempted."""

    def check(s: HivedScheduler, d: Decision | None) -> None:
        if d is not None:
            assert d.kind == "wait" and d.downgraded == (), d
        row = s.status()["groups"][name]
        assert row["priority"] == 1 and not row["downgraded"]

    return check


G29 = group("group29", "VC1", 2, pods(4, 16))
BACKTRACKING = [
    Step(
        "pod39-within-suggested",
        ask(
            group("group27", "VC1", 1, pods(2, 16)),
            [("pod", "0.0.3.2", ALL16), ("pod", "0.0.3.3", ALL16)],
            on=["0.0.3.2", "0.0.3.3"],
        ),
        placed(("pod", "0.0.3.2", ALL16), ("pod", "0.0.3.3", ALL16)),
    ),
    Step(
        "pod40-backtracks-to-the-suggested-node",
        ask(group("group28", "VC1", 1, pods(1, 16)), [("pod", "0.0.4.3", ALL16)], on=["0.0.4.3"]),
        placed(("pod", "0.0.4.3", ALL16)),
    ),
    Step(
        "pod41-reverts-lazy-preemption-of-group27",
        ask(G29, on=["0.0.3.2", "0.0.3.3", "0.0.4.3"]),
        still_allocated("group27"),
    ),
    Step("pod41-reverts-lazy-preemption-of-group28", nothing, still_allocated("group28")),
]


@pytest.mark.parametrize(("steps", "k"), cases(SUGGESTED))
def test_suggested_nodes(steps: list[Step], k: int) -> None:
    replay(HivedScheduler(design()), steps, k)


@pytest.mark.parametrize(("steps", "k"), cases(BACKTRACKING))
def test_suggested_nodes_backtracking_cell_search(steps: list[Step], k: int) -> None:
    replay(HivedScheduler(design(backtracking_config)), steps, k)


# ------------------------------------------------------------------------------ testStatefulPreemption
def preempts_on_the_other_node(s: HivedScheduler, d: Decision | None) -> None:
    """pod31 also preempts pod28, for the pinned node pod29 has not reserved."""
    preempts("group19")(s, d)
    assert sorted([reservation_nodes(s, "group20"), reservation_nodes(s, "group22")]) == [{"0.0.3.0"}, {"0.0.3.1"}]


def cancelled(*names: str) -> Check:
    def check(s: HivedScheduler, d: Decision | None) -> None:
        assert not set(names) & set(s.status()["reservations"])

    return check


def one_pinned_node(s: HivedScheduler, d: Decision | None) -> None:
    """Tie: HiveD puts pod34 on 0.0.3.0; after pod28 is deleted both pinned nodes are free and equivalent."""
    (p,) = placements(d)
    assert p.node in PINNED_NODES and p.gpus == ALL16


def cancelled_preemption_restores_cells(s: HivedScheduler, d: Decision | None) -> None:
    """Deleting the preempting pod35 drops group26 and its reservation: pod34's node stays used at pod34's
    priority (4), the other pinned node is free and reserved for nobody."""
    st = s.status()
    assert "group26" not in st["reservations"] and "group26" not in s.groups()
    (p,) = s.group_of("group25")
    assert st["groups"]["group25"]["priority"] == 4
    assert st["nodes"][p.node]["used"] == {"group25": 16}
    assert st["nodes"][(PINNED_NODES - {p.node}).pop()]["used"] == {}


G25 = group("group25", "VC1", 4, pods(1, 16, pin=PIN), lazy=False)
STATEFUL = [
    Step(
        "pod28",
        ask(
            group("group19", "VC1", 1, pods(2, 16, pin=PIN), lazy=False),
            [("pod", "0.0.3.0", ALL16), ("pod", "0.0.3.1", ALL16)],
        ),
        placed(("pod", "0.0.3.0", ALL16), ("pod", "0.0.3.1", ALL16)),
    ),
    Step("pod29-preempts-pod28", ask(group("group20", "VC1", 2, pods(1, 16, pin=PIN))), preempts("group19")),
    Step("pod30-same-priority-waits", ask(group("group21", "VC1", 1, pods(1, 16, pin=PIN))), waits),
    Step(
        "pod31-preempts-pod28-on-the-other-node",
        ask(group("group22", "VC1", 2, pods(1, 16, pin=PIN))),
        preempts_on_the_other_node,
    ),
    Step("pod32-pinned-cell-used-up-waits", ask(group("group23", "VC1", 2, pods(1, 16, pin=PIN))), waits),
    Step("pod33-preempts-pod28", ask(group("group24", "VC1", 3, pods(2, 16, pin=PIN))), preempts("group19")),
    Step("pod33-cancels-pod29-and-pod31", nothing, cancelled("group20", "group22")),
    Step(
        "pod34-placed-once-pod28-is-deleted",
        then(lambda s: s.release("group19"), ask(G25, [("pod", "0.0.3.0", ALL16)])),
        one_pinned_node,
    ),
    Step("pod34-cancels-pod33", nothing, cancelled("group24")),
    Step("pod35-preempts-pod34", ask(group("group26", "VC1", 5, pods(2, 16, pin=PIN))), preempts("group25")),
    Step("pod35-deleted-cancels-its-preemption", lambda s: s.cancel("group26"), cancelled_preemption_restores_cells),
]


@pytest.mark.parametrize(("steps", "k"), cases(STATEFUL))
def test_stateful_preemption(steps: list[Step], k: int) -> None:
    replay(HivedScheduler(design()), steps, k)


# ------------------------------------------------------------------------------------------ testBadNodes
def vc2_in_the_3_node_rack(raw: dict[str, Any]) -> None:
    """VC2's CT1-NODE cell becomes a DGX2-V100-NODE cell of the 3-DGX2 rack (VC1 has two there)."""
    raw["virtualClusters"]["VC2"]["virtualCells"][2]["cellType"] = "3-DGX2-V100-NODE.DGX2-V100-NODE"


def healthy(vc: str) -> Check:
    """All of ``vc``'s cells in the 3-DGX2 chain are healthy: none doomed, none bound to a bad node."""

    def check(s: HivedScheduler, d: Decision | None) -> None:
        row = s.status()["virtualClusters"][vc]
        assert (row["doomedBadCells"], row["badCells"]) == (0, 0), row

    return check


def doomed(vc: str) -> Check:
    """All of ``vc``'s free node cells in the 3-DGX2 chain are bad (only bad hardware is left for them)."""

    def check(s: HivedScheduler, d: Decision | None) -> None:
        row = s.status()["virtualClusters"][vc]
        assert row["doomedBadCells"] == row["cells"]["3-DGX2-V100-NODE/5"]["free"] > 0, row

    return check


def bad(*nodes: str) -> Callable[[HivedScheduler], None]:
    def act(s: HivedScheduler) -> None:
        for n in nodes:
            s.set_node_health(n, False)

    return act


# HiveD dooms a VC's free cells only when that VC alone has more free cells at the level than the chain
# has healthy free cells (VC1: 1 free, VC2: 1 free, healthy free: 0.0.2.2, so none); Apiary does the same.
POD42 = ask(group("group30", "VC1", 0, pods(1, 16)), [("pod", "0.0.2.0", ALL16)], on=["0.0.2.0"])
POD43 = ask(group("group31", "VC2", 0, pods(1, 16)), [("pod", "0.0.2.2", ALL16)], on=["0.0.2.2"])
BAD_NODES = [
    Step("0.0.2.1-bad-VC1-healthy", then(POD42, bad("0.0.2.1")), healthy("VC1")),
    Step("0.0.2.1-bad-VC2-healthy", nothing, healthy("VC2")),
    Step("pod43-takes-the-last-healthy-node-VC1-doomed", POD43, doomed("VC1")),
    Step("pod43-deleted-VC1-healthy", lambda s: s.release("group31"), healthy("VC1")),
    Step("0.0.2.2-bad-VC1-doomed", bad("0.0.2.2"), doomed("VC1")),
    Step("0.0.2.2-bad-VC2-doomed", nothing, doomed("VC2")),
    Step("0.0.2.2-healthy-again-VC1-healthy", lambda s: s.set_node_health("0.0.2.2", True), healthy("VC1")),
    Step("0.0.2.2-healthy-again-VC2-healthy", nothing, healthy("VC2")),
    Step(
        "pod42-deleted-from-bad-node-VC1-doomed",
        then(bad("0.0.2.0", "0.0.2.2"), lambda s: s.release("group30")),
        doomed("VC1"),
    ),
    Step("pod42-deleted-from-bad-node-VC2-doomed", nothing, doomed("VC2")),
]


@pytest.mark.parametrize(("steps", "k"), cases(BAD_NODES))
def test_bad_nodes(steps: list[Step], k: int) -> None:
    """pod42 and pod43 go to their one suggested node (HiveD checks nothing about them; here they must be
    placed there).  After each node change HiveD checks VC1's and VC2's node cells in the 3-DGX2 chain."""
    replay(HivedScheduler(design(vc2_in_the_3_node_rack)), steps, k)


def test_bad_nodes_pods_go_to_their_suggested_node() -> None:
    """The steps above commit pod42 on 0.0.2.0 and pod43 on 0.0.2.2, as HiveD's test does with HiveD's
    answers; Apiary gives the same answers."""
    s = HivedScheduler(design(vc2_in_the_3_node_rack))
    assert {p.node for p in placements(POD42(s))} == {"0.0.2.0"}
    s.check_invariants()
    s.set_node_health("0.0.2.1", False)
    assert {p.node for p in placements(POD43(s))} == {"0.0.2.2"}
    s.check_invariants()


# ----------------------------------------------------------------------------- testSafeRelaxedBuddyAlloc
def relaxed_buddy_config(raw: dict[str, Any]) -> None:
    """VC1: four DGX2-V100-NODE cells in the 4-DGX2 chain (plus two in the 3-DGX2 one and its pinned cells);
    VC2: one 2-DGX2-V100-NODE cell in the 4-DGX2 chain instead of its CT1-NODE."""
    vc1 = raw["virtualClusters"]["VC1"]["virtualCells"]
    vc1[0]["cellNumber"] = 4
    vc1[2]["cellNumber"] = 0
    vc1[3]["cellNumber"] = 0
    vc2 = raw["virtualClusters"]["VC2"]["virtualCells"]
    vc2[2]["cellType"] = "4-DGX2-V100-NODE.2-DGX2-V100-NODE"
    vc2[2]["cellNumber"] = 1


FOUR = ["0.0.3.2", "0.0.3.3", "0.0.4.2", "0.0.4.3"]


def whole_node_of(nodes: set[str]) -> Check:
    def check(s: HivedScheduler, d: Decision | None) -> None:
        (p,) = placements(d)
        assert p.node in nodes and p.gpus == ALL16, p

    return check


SAFE_RELAXED = [
    Step(
        "pod44",
        ask(group("group32", "VC1", 0, pods(1, 16)), [("pod", "0.0.3.2", ALL16)], on=FOUR),
        # Tie: the four suggested nodes are alike (two halves of two 2-node cells); HiveD picks 0.0.3.2.
        whole_node_of(set(FOUR)),
    ),
    Step(
        "pod45-splits-another-rack-when-the-buddy-node-is-bad",
        then(bad("0.0.3.3"), ask(group("group33", "VC1", 0, pods(1, 16)), [("pod", "0.0.4.2", ALL16)], on=FOUR)),
        # HiveD: placed at all ("Cannot split higher level cells when requested level cell is bad") and on 0.0.4.2.
        # Tie: 0.0.4.2 and 0.0.4.3, the healthy suggested nodes of the other 2-node cell, are alike.
        whole_node_of({"0.0.4.2", "0.0.4.3"}),
    ),
    Step(
        "pod46-keeps-vc2s-rack-safe-and-waits",
        then(
            bad("0.0.4.3"),
            ask(group("group34", "VC1", 0, pods(1, 16)), on=["0.0.3.2", "0.0.3.3", "0.0.4.0", "0.0.4.1", *FOUR[2:]]),
        ),
        # Only 0.0.4.0 and 0.0.4.1 are free and healthy: the one whole 2-node cell VC2's cell needs.
        waits,
    ),
]


@pytest.mark.parametrize(("steps", "k"), cases(SAFE_RELAXED))
def test_safe_relaxed_buddy_alloc(steps: list[Step], k: int) -> None:
    replay(HivedScheduler(design(relaxed_buddy_config)), steps, k)


# ----------------------------------------------------------------------------------- testReconfiguration
def reconfigured_design(raw: dict[str, Any]) -> None:
    """HiveD's testReconfiguration edits of the design config."""
    # shorten the DGX2-V100-NODE chain: 16 GPUs right below the node, no 2/4/8-GPU levels
    raw["physicalCluster"]["cellTypes"]["DGX2-V100-NODE"] = {
        "childCellType": DGX2,
        "childCellNumber": 16,
        "isNodeLevel": True,
    }
    cells = raw["physicalCluster"]["physicalCells"]
    # physical cell not found: node 0.0.3.0 is renamed
    cells[7]["cellChildren"][0]["cellChildren"][0]["cellAddress"] = "0.0.3.100"
    # insufficient VC cells: VC2 keeps one of its two DGX1-P100-NODE cells
    raw["virtualClusters"]["VC2"]["virtualCells"][0]["cellNumber"] = 1
    # the 4-node cell of 0.0.4.0-0.0.4.3 is split into four standalone DGX2-V100-NODE cells, and a 4-node
    # cell of new nodes 0.0.4.100-0.0.4.103 is added
    rack = copy.deepcopy(cells[8])
    nodes = [
        {"cellType": "DGX2-V100-NODE", "cellAddress": n["cellAddress"]}
        for h in rack["cellChildren"]
        for n in h["cellChildren"]
    ]
    cells[8] = nodes[0]
    cells.extend(nodes[1:])
    for h in rack["cellChildren"]:
        for n in h["cellChildren"]:
            n["cellAddress"] = n["cellAddress"].replace("0.0.4.", "0.0.4.10")
    cells.append(rack)


def before_reconfiguration() -> HivedScheduler:
    """The state after testReconfiguration's testCasesThatShouldSucceed: HiveD's bind infos committed
    (their own expectations are the test_normal_operations cases).  group11's preemption is left out:
    HiveD's restart forgets preempting groups and lazy-preemption states, so group5 comes back
    guaranteed, as it does here without group11.  pod25 is scheduled, so pod24 is downgraded as HiveD
    re-derives on AddAllocatedPod."""
    s = HivedScheduler(design())
    for st in NORMAL:
        if st.replayed:
            st.act(s)
    s.check_invariants()
    return s


@pytest.mark.parametrize(
    "name",
    [
        # VC2 keeps one DGX1-P100-NODE cell and two CPU-SOCKET cells: no cell of it holds the 5-GPU pod
        # (a task must fit inside one), so group9 runs on as opportunistic, as HiveD lazy-preempts it.
        pytest.param("group9", id="pod8+pod9-vc2-lost-a-node-cell"),
        # 0.0.4.0 and 0.0.4.1 become standalone DGX2-V100-NODE cells where VC1 has one free cell: HiveD
        # (and Apiary) keep group13 running as opportunistic.
        pytest.param("group13", id="pod20+pod21-nodes-split-out-of-their-rack"),
        pytest.param("group15", id="pod24-lazily-preempted-before"),
    ],
)
def test_reconfiguration_lazily_preempts_groups_that_no_longer_fit(name: str) -> None:
    s = before_reconfiguration()
    before = sorted((p.node, p.gpus) for p in s.group_of(name))
    s.reconfigure(design(reconfigured_design))
    s.check_invariants()
    assert name in s.groups(), f"{name} was dropped"
    assert s.status()["groups"][name]["downgraded"]
    assert sorted((p.node, p.gpus) for p in s.group_of(name)) == before


def test_reconfiguration_then_deleting_every_pod_leaves_no_group() -> None:
    s = before_reconfiguration()
    s.reconfigure(design(reconfigured_design))
    s.check_invariants()
    for name in reversed(list(s.groups())):
        s.release(name)
        s.check_invariants()
    assert s.groups() == {} and s.status()["reservations"] == {}


# -------------------------------------------------------------------------- testInvalidInitialAssignment
def too_many_ct1_cells(raw: dict[str, Any]) -> None:
    """VC1 asks two CT1-NODE cells and two CT1 GPUs besides its pinned CT1 GPU; VC2 keeps its CT1-NODE:
    more than the three CT1 nodes hold."""
    vc1 = raw["virtualClusters"]["VC1"]["virtualCells"]
    vc1[0]["cellType"] = "CT1-NODE"
    vc1[1]["cellType"] = "CT1-NODE.CT1"
    vc1[1]["cellNumber"] = 2


def test_invalid_initial_assignment() -> None:
    config = design(too_many_ct1_cells)  # a legal config by itself
    with pytest.raises(ValidationError):
        HivedScheduler(config)


def test_committed_design_config_is_unmodified_by_the_edits() -> None:
    """The edits above work on parsed copies; the committed file stays HiveD's."""
    for edit in (backtracking_config, vc2_in_the_3_node_rack, relaxed_buddy_config, reconfigured_design):
        design(edit)
    assert DESIGN.read_text(encoding="utf-8") == DESIGN_TEXT
    assert yaml.safe_load(DESIGN_TEXT)["virtualClusters"]["VC2"]["virtualCells"][2]["cellType"] == "CT1-NODE"
