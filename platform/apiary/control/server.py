"""The control-plane process: store + migrations + scheduler + scheduling loop + REST API."""

from __future__ import annotations

import logging
import os

import uvicorn

from apiary import gcpolicy
from apiary.api import create_app
from apiary.auth import Directory, bootstrap
from apiary.control.config import check_cluster_config
from apiary.control.loop import SchedulingLoop
from apiary.control.plane import ControlPlane
from apiary.drills.board import DrillBoard
from apiary.response import runtime as response
from apiary.settings import Settings, ensure_cluster_id
from apiary.store import make_engine, migrate, session_factory

logger = logging.getLogger(__name__)


def build_plane(settings: Settings) -> ControlPlane:
    """Check ``home/cluster.yaml``, open (and migrate) the store, rebuild state. Raises
    ValidationError for a bad cluster config, before the store is touched."""
    cluster = check_cluster_config(settings.cluster_path)
    engine = make_engine(settings.db_url)
    migrate(engine)
    return ControlPlane(
        session_factory(engine), cluster, settings.logs_dir, node_lost_after_s=settings.node_lost_after_s,
        config_path=settings.cluster_path, lazy_preemption=settings.lazy_preemption,
        max_instances=settings.max_instances,
    )


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8470) -> None:
    """Run until SIGINT/SIGTERM. Writes ``home/run/control-plane.pid``; serves home's cluster id
    (written here if ``apiary up`` did not) in ``GET /healthz``."""
    plane = build_plane(settings)
    cluster_id = ensure_cluster_id(settings.home_dir)
    directory = Directory(plane.sessions)
    # Before the port opens: the agents and the bridge read their token files once the API answers.
    bootstrap(directory, settings.home_dir, nodes=plane.scheduler.nodes(),
              virtual_clusters=plane.cluster.virtual_clusters, users_file=settings.users_file)
    # Short collector pauses with a large scheduler state (apiary.gcpolicy): at 10,000 nodes a full
    # collection of the whole heap took 450 ms, stalling decisions and requests alike.
    gcpolicy.install()
    loop = SchedulingLoop(plane, tick_s=settings.tick_s, min_interval_s=settings.cycle_min_interval_s)
    loop.start()
    # Incident response: its escalation deadlines are in the store, so the worker picks up the
    # waits a killed control plane left behind.
    incidents, escalator = response.build(
        plane, settings.home_dir, config_path=settings.oncall, public_url=settings.public_url or f"http://{host}:{port}",
        prometheus_url=settings.prometheus_url)
    escalator.start()
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / "control-plane.pid").write_text(str(os.getpid()))
    logger.info("control plane listening on http://%s:%d", host, port)
    try:
        uvicorn.run(
            create_app(plane, cluster_id=cluster_id, directory=directory, settings=settings,
                       drills=DrillBoard(settings.home_dir / "drills.json"), incidents=incidents),
            host=host, port=port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=2,  # agents' long polls must not hold a restart
        )
    finally:
        escalator.stop()
        loop.stop()
