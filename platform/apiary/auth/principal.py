"""Who is calling: the principal a verified token stands for, and what each kind may do.

The trust model (README, "Who may do what"; route by route in :data:`apiary.api.access.ACCESS`):

=============  ==============================  ==================================================
kind           credential                      may
=============  ==============================  ==================================================
``user``       personal token                  submit to the VCs their groups grant; see the jobs
                                               of those VCs; stop, clone and read the logs and
                                               events of their own jobs; read nodes and cluster
                                               status; open incidents while on call
``user``       personal token, admin group     everything (OpenPAI's admin group)
``agent``      one token per node              report, long-poll assignments, push logs: its own
                                               node only, runs assigned to it only
``service``    ``bridge`` token                read every job and event, record flow runs (one
                                               job's each, shared only with its Retry copies), stop
                                               and clone (Cancel / Retry in the Prefect UI),
                                               submit on behalf of an existing user who is no admin,
                                               run a cycle
``service``    ``alertmanager`` token          post alerts to the webhook (no ``?action=``), open
                                               incidents
=============  ==============================  ==================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["user", "agent", "service"]

#: The services with their own token, and what they are.
BRIDGE = "bridge"
ALERTMANAGER = "alertmanager"
SERVICES = (BRIDGE, ALERTMANAGER)


@dataclass(frozen=True)
class Principal:
    """A verified caller. ``name``: the user, node or service name; ``virtual_clusters``: the VCs
    a user's groups grant (admins may use every VC whatever this says); ``expires``: unix seconds
    or None."""

    kind: Kind
    name: str
    token_id: str
    admin: bool = False
    groups: frozenset[str] = field(default_factory=frozenset)
    virtual_clusters: frozenset[str] = field(default_factory=frozenset)
    expires: float | None = None
    #: The storage configs a user's groups grant (admins may use every config whatever this says).
    storage_configs: frozenset[str] = field(default_factory=frozenset)

    @property
    def is_bridge(self) -> bool:
        return self.kind == "service" and self.name == BRIDGE

    @property
    def is_alertmanager(self) -> bool:
        return self.kind == "service" and self.name == ALERTMANAGER

    def is_agent_of(self, node: str) -> bool:
        return self.kind == "agent" and self.name == node

    def can_use(self, virtual_cluster: str) -> bool:
        """May submit to ``virtual_cluster`` and see its jobs."""
        return self.admin or (self.kind == "user" and virtual_cluster in self.virtual_clusters)

    def may_use_storage(self, config: str) -> bool:
        """May mount storage config ``config`` into jobs and read and write its files."""
        return self.admin or (self.kind == "user" and config in self.storage_configs)

    def sees_all_jobs(self) -> bool:
        return self.admin or self.is_bridge

    def may_see(self, job_user: str, virtual_cluster: str) -> bool:
        """May read a job of ``job_user`` in ``virtual_cluster`` (not its logs: :meth:`owns`)."""
        return self.sees_all_jobs() or self.owns(job_user) or self.can_use(virtual_cluster)

    def owns(self, job_user: str) -> bool:
        """May stop, clone and read the logs of ``job_user``'s jobs."""
        return self.admin or self.is_bridge or (self.kind == "user" and self.name == job_user)

    def describe(self) -> str:
        return {"user": f"user {self.name}", "agent": f"the agent of node {self.name}",
                "service": f"the {self.name} service"}[self.kind]
