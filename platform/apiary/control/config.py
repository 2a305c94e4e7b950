"""Checking a cluster config the one way: what ``apiary up`` and ``PUT /api/v2/cluster/config`` share."""

from __future__ import annotations

from pathlib import Path

from apiary.scheduler import HivedScheduler
from apiary.spec.cluster import ClusterConfig, load_cluster_config


def check_cluster_config(source: str | bytes | Path | ClusterConfig) -> ClusterConfig:
    """Load (unless given a ``ClusterConfig``) and check a HiveD cluster config.

    The checks are the parser's (:func:`~apiary.spec.cluster.load_cluster_config`: YAML shape, cell
    types, addresses) and the scheduler's (building a :class:`~apiary.scheduler.HivedScheduler`: every
    VC's virtual cells fit into the physical cells). Raises :class:`~apiary.errors.ValidationError`
    naming the field (for example ``virtualClusters.vc1.virtualCells``) for an illegal config.
    """
    config = source if isinstance(source, ClusterConfig) else load_cluster_config(source)
    HivedScheduler(config)
    return config
