"""Node facts, derived once.

A node's durable state is its ``nodes`` row (:class:`apiary.store.models.Node`): ``healthy`` (its agent
reports), its cordons (``node_cordons``, one per :data:`CORDON_SOURCE`, like Kubernetes taints with
keys), the last heartbeat and metrics URL, and its queued faults (``node_faults``). Whether the
scheduler may place new work on a node is derived from the row by :func:`schedulable` and nowhere
else; the scheduler's node health is only ever set to that value, after the commit that changed the
row.
"""

from __future__ import annotations

import re

from apiary.errors import ValidationError
from apiary.store.models import Node

#: A bare heartbeat from a known, healthy node is kept in memory; its time is written to the store
#: at most this often (agents beat every 2 to 10 s per node, and committing each beat cost a third
#: of a core at 128 nodes; kubelet likewise posts an unchanged node status only every 5 min, its
#: nodeStatusReportFrequency). It must exceed the heartbeat period, or every beat is a write.
#: Lost-node detection reads the in-memory time, which a restart resets to "now" (a fresh grace
#: period), so the stored time is only what `node list` shows after a restart.
HEARTBEAT_PERSIST_S = 60.0

#: At most this many faults may wait for one node's agent (DCGM-style injection is a test tool; a
#: runaway script must not grow the table without bound): more answer 429.
MAX_QUEUED_FAULTS = 100

#: The source of an admin's cordon (``apiary node cordon``, ``PUT /api/v2/nodes/{node}/cordon``).
ADMIN_CORDON = "admin"

#: Who may set a cordon, the key of its row: ``admin``; ``alert:<alertname>`` (an alert action with
#: no incident); ``incident:<id>`` (an incident's mitigation); ``drill:<drill>`` (``drill:stress``);
#: ``chaos:<experiment or action>``. Names: letters, digits and ``_.:-``, at most 100 characters.
CORDON_SOURCE = re.compile(r"(admin|(alert|incident|drill|chaos):[A-Za-z0-9_.:-]{1,100})")

#: The longest cordon reason kept (longer ones are refused, not cut).
MAX_CORDON_REASON = 500


def cordon_source(source: str) -> str:
    """``source`` when it is a :data:`CORDON_SOURCE`; else ValidationError naming ``source``."""
    if not CORDON_SOURCE.fullmatch(source):
        raise ValidationError("source", f"{source!r} is not a cordon source: admin, alert:<alertname>, "
                                        "incident:<id>, drill:<drill> or chaos:<name>")
    return source


def schedulable(row: Node | None) -> bool:
    """True when the scheduler may place new work on the node: it has reported (``healthy``) and
    holds no cordon (from any source). A node without a row has never reported. Kubernetes' equivalent is Ready and not
    ``spec.unschedulable``."""
    return row is not None and bool(row.healthy) and not bool(row.cordoned)
