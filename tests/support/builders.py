"""Builders for test inputs: OpenPAI jobs derived from Lab 6's job files, and schedulers whose nodes
have all reported healthy.

``LAB6`` is ``examples/lab6``: Lab 6's own job and cluster files, copied unmodified from
``shared/reference/lab6``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from apiary.scheduler import HivedScheduler
from apiary.spec.cluster import load_cluster_config

REPO = Path(__file__).resolve().parents[2]
LAB6 = REPO / "examples" / "lab6"


def job_text(n: int, sleep_s: int | None = None, **changes: Any) -> str:
    """Lab 6's ``job-config-<n>.yaml`` as text, changed as a test needs.

    ``sleep_s`` replaces the jobs' ``sleep 5m`` with ``sleep <sleep_s>`` (seconds).  ``changes``
    set fields by dotted path, creating mappings on the way; in keyword names ``__`` stands for
    ``.``: ``job_text(5, taskRoles__train__instances=4)`` or ``job_text(5, **{"defaults.virtualCluster":
    "vc1"})``.  Without changes the file's text is returned verbatim (comments and all).
    """
    text = (LAB6 / f"job-config-{n}.yaml").read_text()
    if sleep_s is not None:
        text = text.replace("sleep 5m", f"sleep {sleep_s}")
    if not changes:
        return text
    doc = yaml.safe_load(text)
    for dotted, value in changes.items():
        node = doc
        *path, last = dotted.replace("__", ".").split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return yaml.safe_dump(doc, sort_keys=False)


def minimal_job(job_name: str = "minimal", /, **changes: Any) -> dict[str, Any]:
    """The smallest valid job as data (one ``train`` role, one GPU, ``echo hi``), with ``changes``
    set by dotted path (``"taskRoles.train.commands"``), creating mappings on the way."""
    data: dict[str, Any] = {
        "protocolVersion": 2,
        "name": job_name,
        "type": "job",
        "prerequisites": [{"name": "img", "type": "dockerimage", "uri": "busybox"}],
        "taskRoles": {
            "train": {
                "dockerImage": "img",
                "resourcePerInstance": {"cpu": 1, "memoryMB": 1024, "gpu": 1},
                "commands": ["echo hi"],
            }
        },
    }
    for dotted, value in changes.items():
        node = data
        *path, last = dotted.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return data


def healthy_scheduler(cluster: Path | str) -> HivedScheduler:
    """A HivedScheduler for the HiveD config at ``cluster`` (a path, or YAML text) with every node
    healthy, as if each node's agent had reported (a new scheduler knows no node's health)."""
    s = HivedScheduler(load_cluster_config(cluster))
    for node in s.nodes():
        s.set_node_health(node, True)
    return s
