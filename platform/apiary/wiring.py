"""The control-plane process's composition root: the one place that builds and connects its parts.

:func:`build_plane` opens (and migrates) the store and builds the :class:`~apiary.control.ControlPlane`;
:func:`wire` builds everything around it for one home (the user directory and its bootstrap, the
alert log and intake, the CI webhook intake, the drill board, incident response with its escalation
worker and the link secret kept in ``home/credentials/incident-links.key``, the scheduling loop);
:func:`app_of` hands every piece to :func:`apiary.api.create_app`, which only mounts routes;
:func:`serve` runs it all until SIGINT/SIGTERM.

This module sits above every layer (it may import the API, the services and the core); nothing
imports it but the CLI.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from apiary import gcpolicy
from apiary.api import create_app
from apiary.auth import Directory, bootstrap
from apiary.ci.intake import WebhookIntake
from apiary.ci.starter import PrefectStarter
from apiary.control.config import check_cluster_config
from apiary.control.loop import SchedulingLoop
from apiary.control.plane import ControlPlane
from apiary.drills.board import DrillBoard
from apiary.ops.alertlog import AlertLog
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.response import runtime as response
from apiary.response.escalator import EscalationWorker
from apiary.response.service import IncidentService
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


@dataclass
class Wiring:
    """Every part of one control-plane process, connected. Nothing runs until :meth:`start`."""

    settings: Settings
    plane: ControlPlane
    cluster_id: str
    directory: Directory
    alert_log: AlertLog
    receiver: AlertReceiver
    ci: WebhookIntake
    drills: DrillBoard
    incidents: IncidentService
    escalator: EscalationWorker
    loop: SchedulingLoop

    def start(self) -> None:
        """Start the scheduling loop and the escalation worker (threads)."""
        self.loop.start()
        self.escalator.start()

    def stop(self) -> None:
        """Stop what :meth:`start` started."""
        self.escalator.stop()
        self.loop.stop()


def wire(settings: Settings, *, public_url: str, plane: ControlPlane | None = None) -> Wiring:
    """Build the process's parts for ``settings``' home over ``plane`` (default: :func:`build_plane`).

    ``public_url``: how people reach the API (the base of signed incident links unless the on-call
    file or ``APIARY_PUBLIC_URL`` says otherwise). Bootstraps the user directory (the agents' and the
    bridge's token files) before returning, so they exist before the port opens. Raises
    ValidationError for a bad cluster config, on-call file or actions config.
    """
    plane = plane or build_plane(settings)
    home = settings.home_dir
    cluster_id = ensure_cluster_id(home)
    directory = Directory(plane.sessions)
    bootstrap(directory, home, nodes=plane.scheduler.nodes(), virtual_clusters=plane.cluster.virtual_clusters,
              users_file=settings.users_file)
    alert_log = AlertLog(plane.sessions)
    receiver = AlertReceiver(plane, ActionsConfig.load(settings.alert_actions), log=alert_log)
    ci = WebhookIntake(plane.sessions, PrefectStarter(settings.ci_pr_deployment, settings.ci_deploy_deployment),
                       settings.github_webhook_secret.get_secret_value() if settings.github_webhook_secret else None)
    # Incident response: its escalation deadlines are in the store, so the worker picks up the
    # waits a killed control plane left behind.
    incidents, escalator = response.build(plane, home, config_path=settings.oncall,
                                          public_url=settings.public_url or public_url,
                                          prometheus_url=settings.prometheus_url)
    loop = SchedulingLoop(plane, tick_s=settings.tick_s, min_interval_s=settings.cycle_min_interval_s)
    return Wiring(settings, plane, cluster_id, directory, alert_log, receiver, ci,
                  DrillBoard(home / "drills.json"), incidents, escalator, loop)


def app_of(w: Wiring) -> FastAPI:
    """The REST API over ``w``'s parts, every one passed explicitly."""
    return create_app(w.plane, w.receiver, cluster_id=w.cluster_id, directory=w.directory, settings=w.settings,
                      drills=w.drills, ci=w.ci, incidents=w.incidents)


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8470) -> None:
    """Run until SIGINT/SIGTERM. Writes ``home/run/control-plane.pid``; serves home's cluster id
    (written here if ``apiary up`` did not) in ``GET /healthz``."""
    w = wire(settings, public_url=f"http://{host}:{port}")
    # Short collector pauses with a large scheduler state (apiary.gcpolicy): at 10,000 nodes a full
    # collection of the whole heap took 450 ms, stalling decisions and requests alike.
    gcpolicy.install()
    w.start()
    run_dir: Path = settings.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "control-plane.pid").write_text(str(os.getpid()))
    logger.info("control plane listening on http://%s:%d", host, port)
    try:
        uvicorn.run(app_of(w), host=host, port=port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=2)  # agents' long polls must not hold a restart
    finally:
        w.stop()
