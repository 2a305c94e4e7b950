"""The HiveD paper's *sharing anomaly*, measured during a replay.

Definition used here: the total time guaranteed jobs (priority >= 0) waited although they would have
started at that moment on a *private cluster* made of exactly their VC's virtual cells (same cell
types, so the same topology; :func:`apiary.sim.cluster.private_cluster`) holding only that VC's
running guaranteed jobs.

How it is computed:

* Each VC gets a private ``HivedScheduler`` (the same code as the shared one).  It *mirrors* the VC's
  running tasks: a real node first used by the VC is mapped to an empty private node of the same
  size and sku, and every task on it is allocated there with the same leaf cell indices, so the
  private state equals the VC's part of the shared cluster up to node names.  (Under HiveD a VC's
  guaranteed jobs use only its own cells, so the mirror is always exact.)  When no empty private
  node is left (a policy without topology guarantees spread the VC over more nodes than it has
  cells), the task is placed by the private scheduler itself; a task it cannot place is left out
  of the mirror and counted in ``mirror_overflow`` (this only makes the private cluster look freer,
  i.e. it can only raise the anomaly of such a policy, never HiveD's).
* After the events of an instant and the scheduling passes, for every VC whose jobs or queue
  changed, the VC's waiting guaranteed jobs are tried on its private scheduler in queue order
  (priority, then submission), each that fits being allocated tentatively (so two jobs cannot
  count the same free cells), then everything tentative is rolled back.  The number that would
  start, times the time to the next event, is added to the total.  The same skip rules as the
  engine bound the work (dominated shapes, a GPU counter check).

HiveD's VC safety makes this 0 by construction: a positive value under ``hived`` is a bug.
``fifo`` has no VCs, so no private cluster to compare with: it reports null.
"""

from __future__ import annotations

import heapq

from apiary.errors import ApiaryError
from apiary.scheduler import HivedScheduler
from apiary.scheduler.types import TaskPlacement
from apiary.sim.cluster import private_cluster, vc_gpus
from apiary.sim.engine import Engine, SimJob, with_pending
from apiary.spec.cluster import ClusterConfig


class SharingAnomaly:
    """Engine observer accumulating :attr:`total` (seconds); see the module docstring."""

    def __init__(self, engine: Engine, config: ClusterConfig) -> None:
        self.engine = engine
        self.total = 0.0
        self.overflow = 0
        self.quota = vc_gpus(config)
        self.private: dict[str, HivedScheduler] = {}
        self.free_nodes: dict[str, dict[tuple[int, str], list[str]]] = {}
        self.node_map: dict[str, dict[str, str]] = {}
        self.refs: dict[str, dict[str, int]] = {}
        self.ptasks: dict[str, dict[str, int]] = {}
        self.placed: dict[str, dict[str, dict[tuple[str, int], tuple[str, str | None, int]]]] = {}
        self.mused: dict[str, int] = {}
        self.fail: dict[str, list[tuple[int, int, int]]] = {}
        self.count: dict[str, int] = {}
        self.counting = 0
        self.touched: set[str] = set()
        self.real_nodes = {n: (i.leaf_cells, i.sku_type) for n, i in engine.sched.nodes().items()}
        for vc in config.virtual_clusters:
            pc = private_cluster(config, vc)
            if pc is None:
                continue
            priv = HivedScheduler(pc)
            self.private[vc] = priv
            by_key: dict[tuple[int, str], list[str]] = {}
            for name, info in priv.nodes().items():
                by_key.setdefault((info.leaf_cells, info.sku_type), []).append(name)
            self.free_nodes[vc] = by_key
            self.node_map[vc], self.refs[vc], self.ptasks[vc], self.placed[vc] = {}, {}, {}, {}
            self.mused[vc], self.fail[vc], self.count[vc] = 0, [], 0
        engine.observer = self

    # ------------------------------------------------------------------ observer
    def __call__(self, what: str, job: SimJob | None, data) -> None:
        if what == "advance":
            if self.counting:
                self.total += self.counting * data[0]
        elif what == "step":
            for vc in self.touched:
                if vc in self.private:
                    n = self._recount(vc)
                    self.counting += n - self.count[vc]
                    self.count[vc] = n
            self.touched.clear()
        elif job is not None and job.priority >= 0 and job.vc in self.private:
            if what == "start":
                self._mirror_start(job, data)
            elif what == "release":
                self._mirror_release(job, data)
            self.touched.add(job.vc)

    # ------------------------------------------------------------------ mirror
    def _mirror_start(self, job: SimJob, placements: list[TaskPlacement]) -> None:
        vc = job.vc
        priv = self.private[vc]
        nmap, refs, ptasks, placed = self.node_map[vc], self.refs[vc], self.ptasks[vc], self.placed[vc]
        mine = placed.setdefault(job.id, {})
        for p in placements:
            inst = (p.task_role, p.index)
            target = nmap.get(p.node)
            if target is None:
                for cand in self.free_nodes[vc].get(self.real_nodes[p.node], ()):
                    if not ptasks.get(cand) and cand not in nmap.values():
                        target = cand
                        break
            done = False
            if target is not None:
                try:
                    priv.allocate(job.id, job.request,
                                  [TaskPlacement(p.task_role, p.index, target, p.leaf_cell_indices, p.gpus)])
                    nmap[p.node] = target
                    refs[p.node] = refs.get(p.node, 0) + 1
                    ptasks[target] = ptasks.get(target, 0) + 1
                    mine[inst] = (target, p.node, len(p.gpus))
                    done = True
                except ApiaryError:
                    done = False
            if not done:
                d = priv.schedule(with_pending(job.request, (inst,)))
                if d.kind == "place" and d.placements:
                    q = d.placements[0]
                    priv.allocate(job.id, job.request, [q])
                    ptasks[q.node] = ptasks.get(q.node, 0) + 1
                    mine[inst] = (q.node, None, len(p.gpus))
                    done = True
                else:
                    priv.cancel(job.id)
            if done:
                self.mused[vc] += len(p.gpus)
            else:
                self.overflow += 1

    def _mirror_release(self, job: SimJob, instances) -> None:
        vc = job.vc
        mine = self.placed[vc].get(job.id)
        if not mine:
            return
        priv = self.private[vc]
        gone = []
        for inst in instances:
            entry = mine.pop(inst, None)
            if entry is None:
                continue
            pnode, real, gpus = entry
            gone.append(inst)
            self.ptasks[vc][pnode] -= 1
            self.mused[vc] -= gpus
            if real is not None:
                self.refs[vc][real] -= 1
                if self.refs[vc][real] == 0:
                    del self.refs[vc][real]
                    del self.node_map[vc][real]
        if gone:
            priv.release(job.id, gone)
        if not mine:
            del self.placed[vc][job.id]
            priv.release(job.id)
        self.fail[vc] = []

    # ------------------------------------------------------------------ check
    def _recount(self, vc: str) -> int:
        heaps = self.engine.queues.get(vc)
        if not heaps:
            return 0
        priv = self.private[vc]
        valid = self.engine._valid
        free = self.quota[vc] - self.mused[vc]
        persisted = self.fail[vc]
        fails = list(persisted)
        persist = True
        tentative: list[tuple[str, list[tuple[str, int]]]] = []
        popped: list = []
        cand = []
        for shape, h in heaps.items():
            while h and not valid(h[0]):
                heapq.heappop(h)
            if h:
                cand.append((h[0][:4], shape))
        heapq.heapify(cand)
        n = 0
        while cand:
            _, shape = heapq.heappop(cand)
            h = heaps[shape]
            while h and not valid(h[0]):
                heapq.heappop(h)
            if not h:
                continue
            job: SimJob = h[0][4]
            if job.priority >= 0:
                shaped = job.shape is not None and job.gang
                if shaped and self._dominated(job, fails):
                    continue
                need = job.gpus if job.gang else 1
                ok = False
                if need <= free:
                    d = priv.schedule(with_pending(job.request, tuple(job.pending)))
                    if d.kind == "place" and d.placements:
                        priv.allocate(job.id, job.request, d.placements)
                        tentative.append((job.id, [(p.task_role, p.index) for p in d.placements]))
                        free -= sum(len(p.gpus) for p in d.placements)
                        ok = True
                    elif d.kind == "preempt":
                        priv.cancel(job.id)
                if ok:
                    n += 1
                    persist = False
                elif shaped and job.shape is not None:
                    f = (job.shape[0], job.shape[1], job.priority)
                    fails.append(f)
                    if persist:
                        persisted.append(f)
                    continue
            popped.append((shape, heapq.heappop(h)))
            if h:
                heapq.heappush(cand, (h[0][:4], shape))
        for shape, e in popped:
            heapq.heappush(heaps[shape], e)
        for jid, insts in reversed(tentative):
            priv.release(jid, insts)
        return n

    @staticmethod
    def _dominated(job: SimJob, fails: list[tuple[int, int, int]]) -> bool:
        assert job.shape is not None  # only shaped gang jobs are asked
        k, g = job.shape
        p = job.priority
        return any(fk <= k and fg <= g and fp >= p for fk, fg, fp in fails)
