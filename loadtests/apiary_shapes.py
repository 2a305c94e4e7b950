"""Locust load shapes for Apiary's profiles: thin wrappers over :func:`apiary.load.profiles.target_users`.

Each profile locustfile (``smoke.py``, ``ramp.py``, ``steady.py``, ``spike.py``) defines one concrete
subclass naming its profile; these bases are abstract, so Locust never picks one by itself. The
run's size comes from ``APIARY_LOAD_USERS`` (people at the peak) and ``APIARY_LOAD_DURATION_S``
(seconds), which ``apiary load run`` sets; without them, the profile's defaults
(:data:`apiary.load.profiles.PROFILES`). The node-agent users (one heartbeat and one long-poll user
per node, ``fixed_count``) come on top of the people and are spawned first, within a second.
"""

from __future__ import annotations

import os

from apiary_users import NodeAgentReports, NodeAgentWatch
from locust import LoadTestShape

from apiary.load.profiles import get_profile, target_users


class ProfileShape(LoadTestShape):
    abstract = True
    #: the shape (apiary.load.profiles.SHAPES) and the profile (PROFILES: its default size) a
    #: concrete subclass runs
    shape = ""
    profile = ""

    def __init__(self) -> None:
        super().__init__()
        p = get_profile(self.profile)
        self.users = int(os.environ.get("APIARY_LOAD_USERS") or p.users)
        self.duration_s = float(os.environ.get("APIARY_LOAD_DURATION_S") or p.duration_s)
        agent_classes = (NodeAgentReports, NodeAgentWatch)
        self.agents = sum(c.fixed_count for c in agent_classes if not c.abstract)

    def tick(self) -> tuple[int, float] | None:
        want = target_users(self.shape, self.get_run_time(), self.users, self.duration_s)
        if want is None:
            return None
        people, rate = want
        if self.runner is not None and self.get_current_user_count() < self.agents:
            rate = max(rate, float(self.agents))  # the fixed agent users go first: spawn them at once
        return self.agents + people, rate


class SteadyShape(ProfileShape):
    """All the people from the start (spawned in about 10 s), held to the end."""

    abstract = True
    shape = "steady"


class RampShape(ProfileShape):
    """A linear climb to the peak over 80% of the run, held for the rest."""

    abstract = True
    shape = "ramp"


class SpikeShape(ProfileShape):
    """A fifth of the people, all of them within a second for the middle third, a fifth again."""

    abstract = True
    shape = "spike"
