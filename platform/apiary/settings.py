"""Typed settings with the ``APIARY_`` environment prefix.

Paths are computed on access from ``home`` so tests can redirect everything with one
variable (``APIARY_HOME``).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The file in home that holds the platform's identity (see :func:`ensure_cluster_id`).
CLUSTER_ID_FILE = "cluster-id"


def ensure_cluster_id(home: Path) -> str:
    """The cluster id recorded in ``home``, written first (a random UUID) if there is none.

    ``apiary up`` calls it on every start, so a home keeps its id for life; the control plane
    serves it in ``GET /healthz`` (``clusterId``) and the CLI refuses a platform whose id is not its
    home's. The file appears whole or not at all (a hard link of a written temporary file, which
    fails if the name exists), so of two starts racing on one home both read the same id.
    """
    path = home / CLUSTER_ID_FILE
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        tmp = home / f".{CLUSTER_ID_FILE}.{os.getpid()}"
        tmp.write_text(f"{uuid.uuid4()}\n", encoding="utf-8")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # the other start won
        finally:
            tmp.unlink()
    return path.read_text(encoding="utf-8").strip()


def parse_uid_range(text: str) -> tuple[int, int]:
    """``"first-last"`` -> ``(first, last)``. Raises ValueError naming the rule."""
    first, sep, last = text.partition("-")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"task uid range {text!r} must be 'first-last'")
    lo, hi = int(first), int(last)
    if not 0 < lo <= hi < 2**32 - 1:
        raise ValueError(f"task uid range {text!r} must satisfy 0 < first <= last < 4294967295")
    return lo, hi


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="APIARY_", extra="ignore")

    home: Path = Field(default=Path("~/.apiary"), description="State directory of the embedded platform.")
    api_url: str | None = Field(
        default=None,
        description="Control-plane URL; overrides the one recorded in home. Several replicas: comma-separated "
                    "URLs, tried in order when one is unreachable.")
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL; default an SQLite file in home (postgresql+psycopg://... for PostgreSQL).",
    )
    node_lost_after_s: float = Field(
        default=30.0, description="A node whose agent has not reported for this long is lost; its tasks are retried."
    )
    agent_heartbeat_s: float = Field(
        default=2.0, ge=0.5, le=60.0,
        description="Node agents: seconds between bare heartbeats (shortened to a third of the time before the "
                    "agent fences itself). Kubelet renews its node lease every 10 s; thousands of nodes beat so.")
    agent_long_poll_s: float = Field(
        default=10.0, ge=1.0, le=60.0,
        description="Node agents: seconds one assignments long poll may wait for a change (the API allows <= 60).")
    alert_actions: Path | None = Field(
        default=None, description="Alert actions config (YAML); default the packaged default-actions.yaml."
    )
    lazy_preemption: bool = Field(
        default=False,
        description="HiveD lazy preemption: downgrade victims to opportunistic, stop them only if needed.",
    )
    tick_s: float = Field(default=1.0, description="Scheduling-loop period when nothing wakes it earlier, seconds.")
    cycle_min_interval_s: float = Field(
        default=0.05, ge=0.0, le=10.0,
        description="Shortest time from one scheduling cycle's start to the next, seconds: under a stream of "
                    "submissions each cycle decides a batch of them (apiary.control.loop).",
    )
    token: str | None = Field(
        default=None, description="Bearer token of CLI and client calls; default the file home/token (apiary login)."
    )
    users_file: Path | None = Field(
        default=None, description="Static YAML of groups and users that apiary up seeds (apiary.auth.bootstrap)."
    )
    metrics_public: bool = Field(default=True, description="Serve /metrics without a token (Prometheus scrapes it).")
    max_body_bytes: int = Field(default=1_048_576, description="Largest request body the API reads; larger is 413.")
    storage_max_upload_bytes: int = Field(
        default=10 * 1024**3, ge=0,
        description="Largest file a storage upload (PUT /api/v2/storages/configs/<name>/files) takes; larger is 413.")
    image_build_max_bytes: int = Field(
        default=256 * 1024**2, ge=0,
        description="Largest build directory (the uploaded tar, and unpacked) of POST /api/v2/images/builds; "
                    "larger is 413.")
    registry: str | None = Field(
        default=None,
        description="The platform registry's host:port (the image catalogue, user builds); default the one "
                    "apiary up --runtime docker recorded in home/run/urls.json, none with the process runtime.")
    max_instances: int = Field(default=1000, description="Most task instances one job may have (all roles).")
    rate_calls: str = Field(default="600/minute", description="API calls per user (limits notation; OpenPAI's).")
    rate_submits: str = Field(default="3600/hour", description="Job submissions per user (limits notation).")
    oncall: Path | None = Field(
        default=None, description="Incident response config (schedules, policies, routing, channels, rules); "
                                  "default home/oncall.yaml if present (apiary.response.config).")
    prometheus_url: str | None = Field(
        default=None, description="Prometheus the incidents' evidence queries go to (apiary up --monitoring sets it).")
    mlflow_url: str | None = Field(
        default=None, description="The MLflow tracking server (the model registry) as the control plane and the "
                                  "tasks' nodes reach it; apiary up sets it when it runs MLflow. Unset: no MLflow "
                                  "(tasks get no MLFLOW_* variables, the models routes list nothing).")
    mlflow_ui_url: str | None = Field(
        default=None, description="MLflow's UI as people reach it, for run links (default: mlflow_url).")
    public_url: str | None = Field(
        default=None, description="The API's URL as people reach it: the base of signed incident links.")
    github_webhook_secret: SecretStr | None = Field(
        default=None,
        description="GitHub webhook secret (POST /api/v2/ci/webhooks/github); unset: the intake accepts nothing.",
    )
    ci_pr_deployment: str = Field(
        default="platform-ci/pr", description="Prefect deployment (flow/deployment) a pull request starts."
    )
    ci_deploy_deployment: str = Field(
        default="platform-deploy/main", description="Prefect deployment a push to the default branch starts."
    )
    allow_unisolated_tasks: bool = Field(
        default=False,
        description="Development only: when the agent is not root (so cannot switch a task to its own uid), the "
                    "process runtime runs tasks as the agent's user instead of refusing them. Such tasks can read "
                    "every file the agent can (its tokens included).",
    )
    task_uids: str = Field(
        default="2000000000-2000099999",
        description="Uids (first-last, inclusive) the process runtime gives its tasks, one per running task "
                    "(apiary.runtime.isolation); no user or group entries are needed.",
    )
    task_scratch: Path = Field(
        default=Path("/var/tmp/apiary-tasks"),
        description="Where the process runtime makes each running task's home directory (owned by the task's "
                    "uid, removed when the task ends); must be outside APIARY_HOME.",
    )

    # Many machines: TLS, joining, replicas. See README "Running on many machines".
    ca_cert: Path | None = Field(
        default=None,
        description="The platform CA's certificate (PEM). Clients (the CLI, agents, the bridge, the flows, other "
                    "replicas) verify the control plane's HTTPS certificate against it; unset: the system's CAs.",
    )
    ca_key: Path | None = Field(
        default=None,
        description="The platform CA's private key (PEM, 0600) on control-plane hosts, as kubeadm keeps ca.key on "
                    "control-plane nodes: with it a node's join also signs the node's serving certificate (its "
                    "/metrics over HTTPS); unset: joins issue no certificate.",
    )
    tls_cert: Path | None = Field(
        default=None, description="This component's server certificate (PEM, signed by the platform CA); with "
                                  "tls_key the control plane serves HTTPS instead of HTTP.")
    tls_key: Path | None = Field(default=None, description="The private key of tls_cert (PEM, mode 0600).")
    node_credentials: Literal["home", "join"] = Field(
        default="home",
        description="How node agents get their credentials: 'home' (apiary up: the control plane writes every "
                    "node's agent token into home/credentials, for agents on the same machine) or 'join' (nodes on "
                    "other hosts join with a bootstrap token: apiary agent join; nothing is written).",
    )
    advertise_url: str | None = Field(
        default=None,
        description="This control-plane replica's URL as the other replicas and clients reach it (the lease "
                    "names it, followers forward writes to it); default built from --host and --port.",
    )
    replica_id: str | None = Field(
        default=None, description="This control-plane replica's identity in the leader lease; default "
                                  "<hostname>:<home>, so a restarted replica takes its own lease back at once.")
    leader_elect: bool | None = Field(
        default=None,
        description="Elect one leader among control-plane replicas with a lease in the store; default: on with "
                    "PostgreSQL, off with SQLite (one replica only).",
    )
    # Kubernetes' leader election uses 15 s / 10 s / 2 s (kube-controller-manager's --leader-elect-*
    # defaults); shorter here so a killed leader is replaced within 10 s.
    lease_duration_s: float = Field(
        default=6.0, gt=0, description="How long a leader lease lasts without a renew before another replica may "
                                       "take it (Kubernetes' leaseDuration).")
    renew_deadline_s: float = Field(
        default=4.0, gt=0, description="A leader that could not renew for this long steps down (Kubernetes' "
                                       "renewDeadline); shorter than lease_duration_s.")
    retry_period_s: float = Field(
        default=1.0, gt=0, description="How often replicas try to acquire or renew the lease (Kubernetes' "
                                       "retryPeriod).")

    @field_validator("task_uids")
    @classmethod
    def _uid_range(cls, value: str) -> str:
        parse_uid_range(value)  # raises ValueError naming the rule
        return value

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser()

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home_dir / 'apiary.db'}"

    @property
    def logs_dir(self) -> Path:
        return self.home_dir / "task-logs"

    @property
    def run_dir(self) -> Path:
        return self.home_dir / "run"

    @property
    def token_path(self) -> Path:
        """The CLI's token (``apiary login``; ``apiary up`` writes the first admin's), mode 0600."""
        return self.home_dir / "token"

    @property
    def credentials_dir(self) -> Path:
        """Machine credentials ``apiary up`` writes (mode 0600): ``agent-<node>.token``,
        ``bridge.token``, ``alertmanager.token``."""
        return self.home_dir / "credentials"

    def resolved_token(self) -> str | None:
        """``APIARY_TOKEN`` if set, else the file ``home/token``; None if neither."""
        if self.token:
            return self.token.strip()
        path = self.token_path
        return path.read_text(encoding="utf-8").strip() or None if path.exists() else None

    @property
    def cluster_path(self) -> Path:
        return self.home_dir / "cluster.yaml"

    def resolved_registry(self) -> str | None:
        """``host:port`` of :attr:`registry`, else of the registry recorded in ``home/run/urls.json``
        (read on every call: ``apiary up`` starts the registry after the control plane); ``None``
        when there is none."""
        if self.registry:
            return self.registry.removeprefix("http://")
        try:
            found = json.loads((self.run_dir / "urls.json").read_text()).get("registry")
        except (OSError, ValueError):
            return None
        return str(found).removeprefix("http://") if found else None

    def cluster_id(self) -> str | None:
        """The platform identity recorded in home (:func:`ensure_cluster_id`); None before the first
        ``apiary up``."""
        path = self.home_dir / CLUSTER_ID_FILE
        return (path.read_text(encoding="utf-8").strip() or None) if path.exists() else None

    def resolved_api_url(self) -> str | None:
        """``APIARY_API_URL`` if set, else the URL a running ``apiary up`` recorded in ``home/run/api_url``."""
        if self.api_url:
            return self.api_url.rstrip("/")
        path = self.run_dir / "api_url"
        return path.read_text().strip() if path.exists() else None
