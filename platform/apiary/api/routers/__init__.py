"""The API's routers, one per resource; :func:`apiary.api.create_app` includes them all."""

from apiary.api.routers import (
    agents,
    alerts,
    ci,
    ci_records,
    cluster,
    drills,
    identity,
    images,
    incidents,
    jobs,
    models,
    nodes,
    proxy,
    ssh,
    storages,
    templates,
)

ALL = (jobs.router, cluster.router, nodes.router, alerts.router, agents.router, identity.router, drills.router,
       ci.router, ci_records.router, incidents.router, storages.router, proxy.router,
       ssh.router, templates.router, images.router, models.router, models.identity_router)

__all__ = ["ALL"]
