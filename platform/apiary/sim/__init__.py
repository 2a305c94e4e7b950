"""``apiary.sim``: Apiary's trace-driven simulator: the live platform's lifecycle core
(:mod:`apiary.lifecycle.reducer`) and scheduler on a simulated clock with simulated nodes and agents.
The simulator keeps only its clock, event heap, queues and trace handling.

* :func:`replay` (``apiary sim trace``): a job trace on a cluster under ``hived``
  (:class:`apiary.scheduler.HivedScheduler`), ``quota`` and ``fifo`` (:mod:`apiary.sim.policies`).
* :func:`run_scenario` (``apiary sim scenario``): a timed event list (submit, fail-node,
  recover-node) against a HiveD cluster config, with the live platform's semantics.

Rules (trace formats, task split, quota derivation, sharing anomaly) are documented in
:mod:`apiary.sim.trace`, :mod:`apiary.sim.cluster` and :mod:`apiary.sim.anomaly`.
"""

from apiary.sim.cluster import derive_quotas, load_machines, machines_to_cluster
from apiary.sim.engine import Engine, SimJob
from apiary.sim.policies import FifoScheduler, QuotaScheduler
from apiary.sim.replay import POLICIES, replay, replay_policy
from apiary.sim.scenario import run_scenario
from apiary.sim.trace import TraceJob, load_trace, task_split

__all__ = [
    "POLICIES",
    "Engine",
    "FifoScheduler",
    "QuotaScheduler",
    "SimJob",
    "TraceJob",
    "derive_quotas",
    "load_machines",
    "load_trace",
    "machines_to_cluster",
    "replay",
    "replay_policy",
    "run_scenario",
    "task_split",
]
