"""The control-plane process's composition root: the one place that builds and connects its parts.

:func:`build_plane` opens (and migrates) the store and builds the :class:`~apiary.control.ControlPlane`;
:func:`wire` builds everything around it for one home (the user directory and its bootstrap, the
alert log and intake, the CI webhook intake, the drill board, incident response with its escalation
worker and the link secret kept in ``home/credentials/incident-links.key``, the scheduling loop);
:func:`app_of` hands every piece to :func:`apiary.api.create_app`, which only mounts routes, and
wraps it in the replica middleware (:mod:`apiary.api.replica`); :func:`serve` runs it all until
SIGINT/SIGTERM, over HTTPS when ``tls_cert`` and ``tls_key`` are set.

Replicas. With PostgreSQL (``leader_elect`` None or True) the process is one replica of a
replicated control plane: a :class:`~apiary.control.leader.LeaderElector` competes for the
``control-plane`` lease, every commit of the plane's sessions is fenced by the lease's epoch
(:mod:`apiary.store.fencing`), and the work that writes on its own (the scheduling loop, the
escalation worker with its periodic triage) runs only while this replica leads, started after its
memory was rebuilt from the store (``recover``). A follower serves reads from the store and
forwards everything else to the leader. A leader that loses its lease exits with
:data:`~apiary.control.leader.STEPPED_DOWN_EXIT` after the requests in flight were answered (their
writes refused by the fence); its supervisor starts it again as a follower. SQLite runs one
replica: no election, it leads at epoch 0 (``leader_elect=True`` with SQLite is refused). The
user directory's bootstrap (idempotent) runs on every replica at start, before the fence.

This module sits above every layer (it may import the API, the services and the core); nothing
imports it but the CLI.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from sqlalchemy import Engine

from apiary import gcpolicy, gilpolicy
from apiary.api import create_app
from apiary.api.replica import ReplicaRouter
from apiary.auth import Directory, bootstrap
from apiary.auth.bootstrap import ADMIN_USER, DEFAULT_GROUP
from apiary.ci.intake import WebhookIntake
from apiary.ci.starter import PrefectStarter
from apiary.client import http_verify
from apiary.control.config import check_cluster_config
from apiary.control.health import ReplicaRole
from apiary.control.leader import LeaderElector, default_identity
from apiary.control.loop import SchedulingLoop
from apiary.control.plane import ControlPlane
from apiary.control.proxy import KEY_FILE as PROXY_KEY_FILE
from apiary.control.proxy import InstanceSecrets
from apiary.control.proxy import load_key as load_proxy_key
from apiary.drills.board import DrillBoard
from apiary.errors import ConflictError, ValidationError
from apiary.images.service import DockerBuilder, ImageService
from apiary.marketplace import models as model_registry
from apiary.marketplace.identity import KEY_FILE as MLFLOW_KEY_FILE
from apiary.marketplace.templates import TemplateService, load_template_files
from apiary.mounts.files import DIR_MODE
from apiary.mounts.table import MountTable
from apiary.ops.alertlog import AlertLog
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.pki import server_ssl_kwargs
from apiary.response import runtime as response
from apiary.response.escalator import EscalationWorker
from apiary.response.service import IncidentService
from apiary.settings import Settings, ensure_cluster_id
from apiary.storage.files import StorageFiles
from apiary.storage.service import MountPlanner, StorageService
from apiary.store import make_engine, migrate, session_factory
from apiary.store.fencing import CONTROL_PLANE_LEASE, Fence, bound_idle_transactions, install_fence

logger = logging.getLogger(__name__)

#: Seconds a stepped-down replica waits for its requests in flight before it exits regardless.
STEP_DOWN_GRACE_S = 5.0


def electing(settings: Settings) -> bool:
    """Whether this process elects a leader: ``leader_elect``, default on with PostgreSQL and off
    with SQLite. Raises ValidationError (``APIARY_LEADER_ELECT``) for election over SQLite."""
    sqlite = settings.db_url.startswith("sqlite")
    if settings.leader_elect and sqlite:
        raise ValidationError("APIARY_LEADER_ELECT", "leader election needs PostgreSQL (set APIARY_DATABASE_URL); "
                                                     "SQLite runs a single control-plane replica")
    return (not sqlite) if settings.leader_elect is None else settings.leader_elect


def build_plane(settings: Settings) -> ControlPlane:
    """Check ``home/cluster.yaml``, open (and migrate) the store, rebuild state. Raises
    ValidationError for a bad cluster config, before the store is touched."""
    cluster = check_cluster_config(settings.cluster_path)
    engine = make_engine(settings.db_url)
    if engine.dialect.name == "postgresql":
        # A paused replica's open transaction must not hold row locks (and so a takeover, or the new
        # leader's writes) for longer than a lease.
        bound_idle_transactions(engine, settings.lease_duration_s)
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
    #: This replica's identity in the lease and its advertised URL.
    identity: str = ""
    url: str = ""
    #: The election (None: one replica, SQLite or ``leader_elect=False``) and the fence of its writes.
    elector: LeaderElector | None = None
    fence: Fence | None = None
    #: Storage servers and configs, and their files as the control plane serves them.
    storage: StorageService | None = None
    storage_files: StorageFiles | None = None
    #: The image catalogue over the platform registry, and user builds on this machine's dockerd.
    images: ImageService | None = None
    #: The job templates of the marketplace.
    templates: TemplateService | None = None
    #: The model registry of the marketplace (MLflow read as the caller) and its identity route.
    models: model_registry.ModelRegistryParts | None = None
    _working: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        """One replica: start the leader's work now. Replicas: start the election; the leader's
        work starts when this replica takes the lease (:meth:`start_leading`)."""
        if self.elector is None:
            self.start_leading(0)
        else:
            self.elector.start()

    def start_leading(self, epoch: int) -> None:
        """This replica leads at ``epoch``: rebuild memory from the store (a follower's is stale),
        then start the scheduling loop and the escalation worker; from then on it serves every request."""
        if self.elector is not None:
            self.plane.recover()
            if not self.elector.leading:  # stepped down while recovering
                return
        self.loop.start()
        self.escalator.start()
        self._working.set()
        logger.info("control plane %s leads at epoch %d: scheduling loop and escalation worker started",
                    self.identity or "(single replica)", epoch)

    def stop_leading(self, why: str) -> None:
        """This replica lost the lease: serve as a follower and stop the leader's work (in a thread of
        its own: the caller may be the loop or the worker whose write was refused)."""
        was = self._working.is_set()
        self._working.clear()
        if was:
            threading.Thread(target=self._stop_work, name="stop-leading", daemon=True).start()

    def _stop_work(self) -> None:
        self.escalator.stop()
        self.loop.stop()

    def role(self) -> ReplicaRole:
        """This replica's role now (the replica middleware and ``/healthz`` read it)."""
        fenced = self.fence.refused if self.fence is not None else 0
        if self.elector is None:
            return ReplicaRole("leader", self.url, 0, self.identity, fenced)
        seen = self.elector.observed
        epoch = seen.epoch if seen is not None else None
        if self._working.is_set() and self.elector.leading:
            return ReplicaRole("leader", self.url, epoch, self.identity, fenced)
        known = seen is not None and not seen.expired and seen.holder not in ("", self.identity)
        return ReplicaRole("follower", seen.holder_url if known and seen is not None else "", epoch, self.identity,
                           fenced)

    def settle(self, timeout_s: float = 5.0) -> None:
        """Wait (at most ``timeout_s``) for the first election round and, when it won the lease, for
        the leader's work to start: a sole replica then leads as soon as its port opens."""
        if self.elector is None:
            return
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.elector.observed is not None and (not self.elector.leading or self._working.is_set()):
                return
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop what :meth:`start` started (the lease is left to expire), and unmount the storage
        the files API mounted."""
        if self.storage_files is not None:
            self.storage_files.close()
        if self.elector is not None:
            self.elector.stop()
        if self._working.is_set():
            self._working.clear()
            self._stop_work()


def wire(settings: Settings, *, public_url: str, plane: ControlPlane | None = None,
         exit: Callable[[int], None] = os._exit) -> Wiring:
    """Build the process's parts for ``settings``' home over ``plane`` (default: :func:`build_plane`).

    ``public_url``: how people reach the API (the base of signed incident links unless the on-call
    file or ``APIARY_PUBLIC_URL`` says otherwise), and this replica's advertised URL unless
    ``advertise_url`` is set. Bootstraps the user directory (the agents' and the bridge's token
    files) before returning, so they exist before the port opens. When electing (:func:`electing`)
    it builds the elector and fences the plane's sessions; ``exit`` is what a replica that steps
    down calls with :data:`~apiary.control.leader.STEPPED_DOWN_EXIT`. Raises ValidationError for a
    bad cluster config, on-call file, actions config or election setting.
    """
    elect = electing(settings)
    plane = plane or build_plane(settings)
    home = settings.home_dir
    cluster_id = ensure_cluster_id(home)
    directory = Directory(plane.sessions)
    # node_credentials=join: nodes on other hosts join with bootstrap tokens; a token file in this
    # home would be a credential no agent reads, and would count as the node having joined.
    agent_nodes = plane.scheduler.nodes() if settings.node_credentials == "home" else []
    bootstrap(directory, home, nodes=agent_nodes, virtual_clusters=plane.cluster.virtual_clusters,
              users_file=settings.users_file)
    alert_log = AlertLog(plane.sessions)
    receiver = AlertReceiver(plane, ActionsConfig.load(settings.alert_actions), log=alert_log)
    ci = WebhookIntake(plane.sessions, PrefectStarter(settings.ci_pr_deployment, settings.ci_deploy_deployment),
                       settings.github_webhook_secret.get_secret_value() if settings.github_webhook_secret else None)
    # Incident response: its escalation deadlines are in the store, so the worker picks up the
    # waits a killed control plane left behind.
    incidents, escalator = response.build(plane, home, config_path=settings.oncall,
                                          public_url=settings.public_url or public_url,
                                          prometheus_url=settings.prometheus_url, ca_cert=settings.ca_cert)
    loop = SchedulingLoop(plane, tick_s=settings.tick_s, min_interval_s=settings.cycle_min_interval_s)
    storage = StorageService(plane.sessions)
    plane.agents.plan_mounts = MountPlanner(storage, directory.storage_grants).plan
    # Each launch's proxy secret (apiary.control.proxy), under a key kept in the home so that a
    # restarted control plane still reaches the tasks its predecessor launched.
    plane.agents.instance_secrets = InstanceSecrets(load_proxy_key(home / PROXY_KEY_FILE))
    if settings.node_credentials == "home":
        bootstrap_home_storage(storage, directory, home)
    files = StorageFiles(storage, MountTable(home / "storage-mounts"),
                         max_upload_bytes=settings.storage_max_upload_bytes)
    files.close()  # what a control plane killed before its stop left mounted
    w = Wiring(settings, plane, cluster_id, directory, alert_log, receiver, ci,
               DrillBoard(home / "drills.json"), incidents, escalator, loop,
               identity=settings.replica_id or default_identity(home),
               url=(settings.advertise_url or public_url).rstrip("/"), storage=storage, storage_files=files)
    w.images = ImageService(settings.resolved_registry, builder=DockerBuilder(),
                            max_context_bytes=settings.image_build_max_bytes)
    w.templates = TemplateService(plane.sessions)
    bootstrap_templates(w.templates, home)
    # The model registry (MLflow, when apiary up runs it): each launch gets the tracking server and a
    # secret of its own run (home/credentials/mlflow-task.key); templates resolve models as their caller.
    w.models = model_registry.build(plane.sessions, directory, home / MLFLOW_KEY_FILE, mlflow_url=settings.mlflow_url,
                            ui_url=settings.mlflow_ui_url)
    plane.agents.task_env = w.models.task_env
    w.templates.resolver = w.models.resolve
    if elect:
        engine: Engine = plane.sessions.kw["bind"]
        # The election's own commits go through sessions without the fence (they change the lease it checks).
        w.elector = LeaderElector(
            session_factory(engine), identity=w.identity, url=w.url, lease_duration_s=settings.lease_duration_s,
            renew_deadline_s=settings.renew_deadline_s, retry_period_s=settings.retry_period_s,
            on_started_leading=w.start_leading, on_stopped_leading=w.stop_leading, exit=exit)
        w.fence = install_fence(plane.sessions, CONTROL_PLANE_LEASE, w.identity, lambda: w.elector.epoch if
                                w.elector is not None else None, on_refused=w.elector.step_down)
        logger.info("control-plane replica %s (%s) elects a leader on the lease %r in PostgreSQL: lease %.1f s, "
                    "renew deadline %.1f s, retry every %.1f s", w.identity, w.url, CONTROL_PLANE_LEASE,
                    settings.lease_duration_s, settings.renew_deadline_s, settings.retry_period_s)
    else:
        logger.info("single control-plane replica (%s): no leader election; it leads at epoch 0",
                    "SQLite runs one replica" if settings.db_url.startswith("sqlite") else "APIARY_LEADER_ELECT=false")
    return w


#: The storage ``apiary up`` gives a one-machine platform: a ``local`` server over
#: ``home/storage/home`` and a config ``home`` mounting it at ``/mnt/home`` (read-write), granted to
#: the default group. Not a default config: a job mounts it when it names it.
HOME_STORAGE = "home"
HOME_MOUNT_POINT = "/mnt/home"


#: The templates ``apiary up`` publishes: one YAML document per file (apiary.spec.template).
SHIPPED_TEMPLATES = Path(__file__).resolve().parents[2] / "examples" / "marketplace" / "templates"


def bootstrap_templates(templates: TemplateService, home: Path, source: Path = SHIPPED_TEMPLATES) -> list[str]:
    """Publish the shipped templates (``source/*.yaml``) as official ones owned by the admin, once per
    home: ``home/marketplace/.bootstrapped`` records it, so a template an admin deleted or changed
    stays so. A name that exists is left as it is (another replica seeded it). Returns the names
    published. Raises ValidationError for a shipped template that is not valid."""
    marker = home / "marketplace" / ".bootstrapped"
    if marker.exists():
        return []
    docs = load_template_files(source) if source.is_dir() else []
    try:
        published = templates.seed(docs, ADMIN_USER)
    except ConflictError:  # another replica seeded them in the meantime
        published = []
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    logger.info("shipped templates published: %s", ", ".join(published) or "none")
    return published


def bootstrap_home_storage(storage: StorageService, directory: Directory, home: Path) -> None:
    """Create :data:`HOME_STORAGE` (server, config, grant) once per home: ``home/storage/.bootstrapped``
    records that it was done, so an admin who deletes or changes it is not overridden at the next start."""
    marker = home / "storage" / ".bootstrapped"
    if marker.exists():
        return
    root = home / "storage" / HOME_STORAGE
    root.mkdir(parents=True, exist_ok=True)
    # As every directory the platform makes in storage (apiary.mounts.files.DIR_MODE): tasks run as
    # changing uids, so anyone may add and only the owner removes. APIARY_HOME above it stays 0700:
    # tasks reach it only through the bind at /mnt/home.
    os.chmod(root, DIR_MODE)
    storage.put_server(HOME_STORAGE, "local", {"rootPath": str(root)})
    storage.put_config(HOME_STORAGE, default=False, mount_infos=[
        {"mountPoint": HOME_MOUNT_POINT, "server": HOME_STORAGE, "path": "", "permission": "rw"}])
    directory.set_storage_grant(DEFAULT_GROUP, HOME_STORAGE, True)
    marker.touch()


def app_of(w: Wiring) -> FastAPI:
    """The REST API over ``w``'s parts, every one passed explicitly, behind the replica middleware
    (:class:`~apiary.api.replica.ReplicaRouter`, outermost: a follower forwards to the leader)."""
    app = create_app(w.plane, w.receiver, cluster_id=w.cluster_id, directory=w.directory, settings=w.settings,
                     drills=w.drills, ci=w.ci, incidents=w.incidents, storage=w.storage, storage_files=w.storage_files,
                     images=w.images, templates=w.templates,
                     models=w.models.registry if w.models else None,
                     mlflow_identity=w.models.identity if w.models else None)
    app.add_middleware(ReplicaRouter, role=w.role, verify=http_verify(w.settings.ca_cert))
    return app


def tls_files(settings: Settings) -> dict[str, str]:
    """uvicorn's TLS arguments (:func:`apiary.pki.server_ssl_kwargs`) when ``tls_cert`` and
    ``tls_key`` are both set, ``{}`` (plain HTTP) when neither is. Raises ValidationError naming the
    missing one, or a file that does not exist."""
    cert, key = settings.tls_cert, settings.tls_key
    if cert is None and key is None:
        return {}
    if cert is None or key is None:
        missing = "APIARY_TLS_CERT" if cert is None else "APIARY_TLS_KEY"
        raise ValidationError(missing, "HTTPS needs both APIARY_TLS_CERT and APIARY_TLS_KEY")
    return server_ssl_kwargs(cert.expanduser(), key.expanduser())


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8470) -> None:
    """Run until SIGINT/SIGTERM, or until this replica steps down (then the process exits with
    :data:`~apiary.control.leader.STEPPED_DOWN_EXIT` once its requests in flight were answered, at
    most :data:`STEP_DOWN_GRACE_S` later). Writes ``home/run/control-plane.pid``; serves home's
    cluster id (written here if ``apiary up`` did not) in ``GET /healthz``; HTTPS with
    ``tls_cert``/``tls_key``."""
    tls = tls_files(settings)
    scheme = "https" if tls else "http"
    server: uvicorn.Server | None = None
    stepped_down: list[int] = []

    def exit_stepped_down(code: int) -> None:
        # kube-controller-manager exits when it loses its lease; answer the requests in flight first
        # (their writes are refused by the fence), then exit, whatever still runs.
        stepped_down.append(code)
        killer = threading.Timer(STEP_DOWN_GRACE_S, os._exit, args=(code,))
        killer.daemon = True
        killer.start()
        if server is not None:
            server.should_exit = True
        else:
            os._exit(code)

    w = wire(settings, public_url=f"{scheme}://{host}:{port}", exit=exit_stepped_down)
    if w.elector is not None and host in ("0.0.0.0", "::", "") and not settings.advertise_url:
        raise ValidationError("APIARY_ADVERTISE_URL", f"replicas listening on {host or 'every address'} need the "
                                                      "URL the other replicas reach this one at")
    # Short collector pauses with a large scheduler state (apiary.gcpolicy): at 10,000 nodes a full
    # collection of the whole heap took 450 ms, stalling decisions and requests alike.
    gcpolicy.install()
    # A thread back from a socket call gets the GIL sooner (apiary.gilpolicy): 2 ms, not 5.
    gilpolicy.install()
    run_dir: Path = settings.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "control-plane.pid").write_text(str(os.getpid()))
    config = uvicorn.Config(app_of(w), host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2,  # agents' long polls must not hold a restart
                            ssl_certfile=tls.get("ssl_certfile"), ssl_keyfile=tls.get("ssl_keyfile"))
    server = uvicorn.Server(config)
    w.start()
    w.settle()
    logger.info("control plane listening on %s://%s:%d (replica %s, advertised as %s)", scheme, host, port,
                w.identity, w.url)
    # uvicorn shuts down on SIGTERM/SIGINT, puts back the handlers it found and raises the signal
    # again; Python's default handler would then end the process before the stop below (the storage
    # the files API mounted would stay mounted). These take the raised signal, so the stop runs.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        w.stop()
    if stepped_down:
        logging.shutdown()
        os._exit(stepped_down[0])
