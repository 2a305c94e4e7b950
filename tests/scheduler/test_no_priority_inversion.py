"""No priority inversion, on seeded random streams over small multi-VC clusters.

The invariant: a guaranteed job never waits while a strictly
lower-priority job of its own VC, or an opportunistic job, holds cells whose release would let it run.
HiveD gets there by preempting. Every time ``schedule`` answers ``wait`` for a guaranteed group, the
test copies the scheduler, releases every strictly lower-priority group of that VC and every
opportunistic group, and asks again: the copy must not be able to place the group. Groups running on
unhealthy nodes stay: their cells cannot be used anyway, and what their release does to the VC's quota
is HiveD's "doomed bad cell" business, not a preemption. VC safety (``check_invariants``) is checked
after every step too.

The driver plays a platform with instant agents: each step submits a group, ends a running one, or
flips a node's health; then a cycle asks every waiting group in priority order (then arrival), commits
``place``, and answers ``preempt`` by stopping the victims at once (they queue again as new arrivals).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.support.builders import healthy_scheduler

from apiary.scheduler import GroupRequest, HivedScheduler, TaskRequest

REPO = Path(__file__).resolve().parents[2]
PRIORITIES = (-1, 10, 10, 100, 120)  # oppo, test (twice as likely), prod, crit

RACKS = """
physicalCluster:
  skuTypes: {GPU: {gpu: 1, cpu: 4, memory: 32Gi}}
  cellTypes:
    PAIR: {childCellType: GPU, childCellNumber: 2}
    NODE: {childCellType: PAIR, childCellNumber: 2, isNodeLevel: true}
    RACK: {childCellType: NODE, childCellNumber: 2}
  physicalCells:
  - {cellType: RACK, cellChildren: [{cellAddress: r0-n0}, {cellAddress: r0-n1}]}
  - {cellType: RACK, cellChildren: [{cellAddress: r1-n0}, {cellAddress: r1-n1}]}
  - {cellType: RACK, cellChildren: [{cellAddress: r2-n0}, {cellAddress: r2-n1}]}
virtualClusters:
  a: {virtualCells: [{cellType: RACK, cellNumber: 1}, {cellType: RACK.NODE.PAIR, cellNumber: 1}]}
  b: {virtualCells: [{cellType: RACK.NODE, cellNumber: 1}, {cellType: RACK.NODE.PAIR, cellNumber: 2}]}
  c: {virtualCells: [{cellType: RACK.NODE.PAIR, cellNumber: 1}]}
"""

CLUSTERS = {
    "four-nodes-two-vcs": (REPO / "tests" / "sim" / "scenarios" / "hived-parity" / "cluster.yaml").read_text(),
    "racks-three-vcs": RACKS,
}


@dataclass
class Driver:
    sched: HivedScheduler
    rng: random.Random
    waiting: dict[str, GroupRequest] = field(default_factory=dict)  # arrival order
    running: dict[str, GroupRequest] = field(default_factory=dict)
    seq: int = 0
    checked: int = 0
    verified: set[str] = field(default_factory=set)  # waiting groups checked since the last change
    counts: dict[str, int] = field(default_factory=lambda: {"place": 0, "preempt": 0, "wait": 0})

    def submit(self) -> None:
        self.seq += 1
        vcs = list(self.sched.status()["virtualClusters"])
        gang = self.rng.random() < 0.7
        request = GroupRequest(
            name=f"g{self.seq}", virtual_cluster=self.rng.choice(vcs), priority=self.rng.choice(PRIORITIES),
            gang=gang, tasks=(TaskRequest("t", self.rng.choice((1, 1, 2)), self.rng.choice((1, 1, 2, 3, 4)), 1.0, 1),),
        )
        try:
            self.sched.validate(request)
        except Exception:  # larger than its VC: rejected at submission, never queued  # noqa: BLE001
            return
        self.waiting[request.name] = request

    def step(self) -> None:
        r = self.rng.random()
        if (r < 0.55 and len(self.waiting) < 8) or not self.running:  # a bounded queue keeps steps cheap
            self.submit()
        elif r < 0.93:
            name = self.rng.choice(sorted(self.running))
            self.sched.release(name)
            del self.running[name]
        else:  # a node fails, or a failed one comes back: at most one is down at a time
            bad = [n for n, v in self.sched.status()["nodes"].items() if not v["healthy"]]
            if bad:
                self.sched.set_node_health(bad[0], True)
            else:
                self.sched.set_node_health(self.rng.choice(sorted(self.sched.nodes())), False)
        self.cycle()
        self.sched.check_invariants()

    def pending(self, request: GroupRequest) -> GroupRequest:
        placed = {(p.task_role, p.index) for p in self.sched.group_of(request.name)}
        rest = tuple(i for i in request.pending_instances() if i not in placed)
        return GroupRequest(request.name, request.virtual_cluster, request.priority, request.gang, request.tasks, rest)

    def cycle(self) -> None:
        for _ in range(4):  # until nothing changes: preemptions free cells for the next pass
            changed = False
            order = sorted(self.waiting.values(), key=lambda g: -g.priority)  # stable: arrival order
            for request in order:
                if request.name not in self.waiting:
                    continue
                asked = self.pending(request)
                d = self.sched.schedule(asked)
                self.counts[d.kind] += 1
                if d.kind == "place":
                    self.sched.allocate(request.name, request, d.placements)
                    self.running[request.name] = request
                    if len(d.placements) == len(asked.pending_instances()):
                        del self.waiting[request.name]
                    changed = True
                elif d.kind == "preempt":
                    for victim in d.victims:  # instant agents: the victims stop now and queue again
                        self.sched.release(victim)
                        self.waiting[victim] = self.running.pop(victim)
                    changed = True
                elif request.priority >= 0 and request.name not in self.verified:
                    self.check_no_inversion(asked)
            if changed:
                self.verified.clear()  # the state moved: a wait may now be an inversion
            else:
                return

    def check_no_inversion(self, request: GroupRequest) -> None:
        self.checked += 1
        self.verified.add(request.name)
        vc, p = request.virtual_cluster, request.priority
        status = self.sched.status()
        bad = {n for n, v in status["nodes"].items() if not v["healthy"]}
        releasable = [
            name for name, g in status["groups"].items()
            if name != request.name and not any(pl["node"] in bad for pl in g["placements"])
            and (g["priority"] < 0 or (g["vc"] == vc and g["priority"] < p))
        ]
        if not releasable:  # nothing it could preempt: a wait is no inversion
            return
        other = copy.deepcopy(self.sched)
        for name in releasable:
            other.release(name)
        d = other.schedule(request)
        assert d.kind != "place", (
            f"priority inversion: {request.name} ({vc}, priority {p}) waits ({self.sched.schedule(request).reason}) "
            f"but would be placed on {[(x.node, x.gpus) for x in d.placements]} if lower-priority and "
            f"opportunistic work were gone"
        )


@pytest.mark.parametrize("cluster", list(CLUSTERS))
@pytest.mark.parametrize("seed", [1, 2])
def test_no_guaranteed_job_waits_behind_lower_priority_work(cluster: str, seed: int) -> None:
    sched = healthy_scheduler(CLUSTERS[cluster])
    driver = Driver(sched, random.Random(seed))
    for _ in range(1200):
        driver.step()
    # Not vacuous: the streams place, preempt and wait, and the invariant was asked many times.
    assert driver.counts["place"] > 300 and driver.counts["preempt"] > 5 and driver.checked > 100, driver.counts
