"""The API's routers, one per resource; :func:`apiary.api.create_app` includes them all."""

from apiary.api.routers import (
    agents,
    alerts,
    ci,
    ci_records,
    cluster,
    drills,
    identity,
    incidents,
    jobs,
    nodes,
    proxy,
    ssh,
    storages,
)

ALL = (jobs.router, cluster.router, nodes.router, alerts.router, agents.router, identity.router, drills.router,
       ci.router, ci_records.router, incidents.router, storages.router, proxy.router,
       ssh.router)

__all__ = ["ALL"]
