"""One Apiary platform whose components run as containers (host networking) from Apiary's images.

The CI/CD flows use it twice: a throw-away *staging* platform from freshly built images for the
tests, and the long-lived *production* platform that :func:`apiary.ci.rollout.rollout` rolls
forward one component at a time. This module is the I/O; the decisions are in ``rollout``.

Layout (``name`` is the platform's name, e.g. ``production`` or ``staging-<sha>``)::

    apiary-<name>-control-plane   image control-plane: `apiary control-plane --host 127.0.0.1 --port P`
    apiary-<name>-agent           image agent: `apiary agent --api URL --all-nodes --simulated-gpus ...`
    apiary-<name>-bridge          image prefect: `apiary prefect-bridge ...` (only with a Prefect URL)

Each container carries the labels ``apiary.platform=<name>``, ``apiary.component=<component>`` and
``apiary.image=<the image name it was started from>`` (:meth:`ContainerPlatform.current_images`
reads them back: an image id would not tell ``r1`` from a re-tag ``r2``).

``home`` is the platform's ``APIARY_HOME`` on the host (cluster.yaml, the SQLite store, the
tokens, the agents' state) and is bind-mounted into every container **at the same path**, so the
bind mounts a docker-runtime agent asks the host's dockerd for (the task's run directory) name a
host path. The state survives any container: the control plane's store and the agents' run
records are in ``home``.

Why jobs survive a rollout: with ``agent_runtime="docker"`` the tasks are sibling containers
(label ``apiary.cluster=<home's cluster id>``) on the host's dockerd, not children of the agent.
The agent is replaced with SIGKILL (``apiary agent`` stops its tasks on SIGTERM: that is right
for ``apiary up``'s Ctrl-C, wrong for an upgrade) and its successor re-adopts them from the run
records in ``home``. With the process runtime the tasks live inside the agent's container and die
with it (the control plane retries them as platform retries).

Gates never raise for an unhealthy platform: they return a :class:`GateResult` with what they saw
(the tail of an exited container's log included). ``start``/``replace`` raise
:class:`~apiary.errors.PlatformError` when dockerd refuses (an image that cannot be pulled).
"""

from __future__ import annotations

import logging
import shlex
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from apiary.errors import ApiaryError, PlatformError
from apiary.settings import CLUSTER_ID_FILE

logger = logging.getLogger(__name__)

#: The platform's components, in start order; the bridge only with a Prefect URL.
COMPONENTS = ("control-plane", "agent", "bridge")
#: Component -> the key of its image in :class:`PlatformImages` (the bridge runs from ``prefect``).
COMPONENT_IMAGE = {"control-plane": "control-plane", "agent": "agent", "bridge": "prefect"}
#: Labels on every container of a platform.
PLATFORM_LABEL = "apiary.platform"
COMPONENT_LABEL = "apiary.component"
IMAGE_LABEL = "apiary.image"
#: The label the docker runtime puts on task containers (:mod:`apiary.runtime.docker`).
CLUSTER_LABEL = "apiary.cluster"

@dataclass(frozen=True)
class PlatformImages:
    """The three images of a platform release (full names, ``<registry>/apiary/<name>:<tag>``)."""

    control_plane: str
    agent: str
    prefect: str

    @classmethod
    def from_registry(cls, registry: str, tag: str) -> PlatformImages:
        """The names :func:`apiary.images.build.build_platform` pushes for ``tag``."""
        return cls(*(f"{registry}/apiary/{name}:{tag}" for name in ("control-plane", "agent", "prefect")))

    def as_dict(self) -> dict[str, str]:
        """``{"control-plane", "agent", "prefect"}`` -> name (the deployment record's ``images``)."""
        return {"control-plane": self.control_plane, "agent": self.agent, "prefect": self.prefect}

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> PlatformImages:
        """The inverse of :meth:`as_dict`; raises ``KeyError`` naming a missing image."""
        return cls(control_plane=data["control-plane"], agent=data["agent"], prefect=data["prefect"])

    def for_component(self, component: str) -> str:
        """The image ``component`` (one of :data:`COMPONENTS`) runs."""
        return self.as_dict()[COMPONENT_IMAGE[component]]


@dataclass(frozen=True)
class GateResult:
    """What one health gate saw: ``ok``, the gate's name, a human ``detail`` and how long it took
    (``duration_s``, seconds)."""

    ok: bool
    gate: str
    detail: str
    duration_s: float


def read_cluster_id(home: Path) -> str | None:
    """The cluster id the control plane recorded in ``home`` (``home/cluster-id``), None before its
    first start. It labels the docker runtime's task containers (``apiary.cluster``)."""
    path = home / CLUSTER_ID_FILE
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


class ContainerPlatform:
    """One platform run as containers on ``client``'s dockerd (see the module doc).

    ``client``: a ``docker.DockerClient``. ``name``: the platform's name (container names and the
    ``apiary.platform`` label). ``home``: its ``APIARY_HOME`` on the host (created). ``port``: the
    API's port on 127.0.0.1. ``cluster_config``: a HiveD config copied to ``home/cluster.yaml`` by
    :meth:`start` (None: ``home`` already has one). ``agent_runtime``: ``process`` (tasks inside the
    agent's container) or ``docker`` (sibling containers through the host's socket, with
    ``image_map`` (a YAML file, bind-mounted read-only at its own path; None: the shipped map) and
    ``registry`` (``host:port``)). ``prefect_api_url``: run the Prefect bridge against this Prefect
    API. ``env``: more environment for every container (``APIARY_NODE_LOST_AFTER_S``...).

    Not thread-safe: one caller drives one platform.
    """

    def __init__(
        self,
        client: Any,
        name: str,
        home: Path,
        port: int,
        *,
        cluster_config: Path | None = None,
        agent_runtime: str = "process",
        image_map: Path | None = None,
        registry: str | None = None,
        prefect_api_url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if agent_runtime not in ("process", "docker"):
            raise ValueError(f"agent_runtime must be process or docker, not {agent_runtime!r}")
        self.client = client
        self.name = name
        self.home = Path(home).expanduser().absolute()
        self.port = port
        self.cluster_config = cluster_config
        self.agent_runtime = agent_runtime
        self.image_map = Path(image_map).absolute() if image_map is not None else None
        self.registry = registry
        self.prefect_api_url = prefect_api_url
        self.env = dict(env or {})

    # -- identity ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def components(self) -> tuple[str, ...]:
        """The components this platform runs: the bridge only with a Prefect URL."""
        return tuple(c for c in COMPONENTS if c != "bridge" or self.prefect_api_url)

    def container_name(self, component: str) -> str:
        return f"apiary-{self.name}-{component}"

    def admin_token(self) -> str:
        """The admin's token the control plane wrote to ``home/token``; raises
        :class:`PlatformError` before the control plane's first start."""
        try:
            token = (self.home / "token").read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise PlatformError(f"no admin token in {self.home / 'token'}: has the control plane started?") from exc
        if not token:
            raise PlatformError(f"{self.home / 'token'} is empty")
        return token

    def cluster_id(self) -> str | None:
        return read_cluster_id(self.home)

    def _api(self, timeout: float = 10.0) -> Any:
        from apiary.client import ApiaryClient

        return ApiaryClient(self.url, timeout=timeout, token=self.admin_token())

    # -- containers --------------------------------------------------------------------------

    def _container(self, component: str) -> Any:
        """The component's container, or None."""
        import docker

        try:
            return self.client.containers.get(self.container_name(component))
        except docker.errors.NotFound:
            return None

    def _run_args(self, component: str) -> dict[str, Any]:
        """``containers.run`` keyword arguments of ``component`` (image aside)."""
        home = str(self.home)
        volumes: dict[str, dict[str, str]] = {home: {"bind": home, "mode": "rw"}}
        env = {"APIARY_HOME": home, **self.env}
        args: dict[str, Any] = {}
        if component == "control-plane":
            command = ["--host", "127.0.0.1", "--port", str(self.port)]
        elif component == "agent":
            command = ["--api", self.url, "--all-nodes", "--simulated-gpus",
                       "--state-dir", str(self.home / "agents"), "--credentials", str(self.home / "credentials"),
                       # each node's dcgm-exporter-style /metrics (the GPU-fault chaos probes read it)
                       "--metrics-ports", "auto"]
            if self.agent_runtime == "docker":
                command += ["--runtime", "docker"]
                volumes["/var/run/docker.sock"] = {"bind": "/var/run/docker.sock", "mode": "rw"}
                if self.image_map is not None:
                    command += ["--image-map", str(self.image_map)]
                    volumes[str(self.image_map)] = {"bind": str(self.image_map), "mode": "ro"}
                if self.registry:
                    command += ["--registry", self.registry]
            else:
                command += ["--workdir", "/opt/apiary"]  # the image's examples (Lab 6 runs examples/mnist)
        elif component == "bridge":
            if not self.prefect_api_url:
                raise ValueError("this platform has no Prefect URL: it runs no bridge")
            creds = self.home / "credentials"
            # The bridge calls Apiary with its service token (never the admin's); read inside the
            # container so the secret is not in the container's configuration (docker inspect).
            script = (
                f"APIARY_TOKEN=\"$(cat {shlex.quote(str(creds / 'bridge.token'))})\"; export APIARY_TOKEN; "
                f"if [ -f {shlex.quote(str(creds / 'prefect-auth'))} ]; then "
                f"PREFECT_API_AUTH_STRING=\"$(cat {shlex.quote(str(creds / 'prefect-auth'))})\"; "
                "export PREFECT_API_AUTH_STRING; fi; "
                f"exec apiary prefect-bridge --api {shlex.quote(self.url)} "
                f"--prefect-api {shlex.quote(self.prefect_api_url)} "
                f"--state {shlex.quote(str(self.home / 'prefect-bridge.json'))}"
            )
            args["entrypoint"] = ["/bin/sh", "-c"]
            command = [script]
            env.update({"PREFECT_API_URL": self.prefect_api_url, "PREFECT_HOME": str(self.home / "prefect"),
                        "APIARY_API_URL": self.url, "DO_NOT_TRACK": "1",
                        "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
        else:
            raise ValueError(f"unknown component {component!r}; one of {', '.join(COMPONENTS)}")
        # init: docker-init as PID 1 forwards SIGTERM (the bridge installs no handler of its own and
        # would otherwise wait out the stop timeout).
        args.update(command=command, environment=env, volumes=volumes, network_mode="host", detach=True, init=True,
                    name=self.container_name(component),
                    labels={PLATFORM_LABEL: self.name, COMPONENT_LABEL: component})
        return args

    def _run(self, component: str, image: str) -> Any:
        import docker

        args = self._run_args(component)
        args["labels"][IMAGE_LABEL] = image
        try:
            container = self.client.containers.run(image, **args)  # pulls a missing image
        except docker.errors.DockerException as exc:
            raise PlatformError(f"cannot start {component} of platform {self.name} from {image}: {exc}") from exc
        logger.info("platform=%s component=%s image=%s container=%s", self.name, component, image,
                    container.short_id)
        return container

    def _remove(self, container: Any) -> None:
        """Remove ``container``; never raises for one already gone. The agent is killed (SIGKILL) so
        its tasks keep running; the others get SIGTERM and 10 s first."""
        import docker

        try:
            if container.labels.get(COMPONENT_LABEL) not in ("agent", None):
                container.stop(timeout=10)
            container.remove(force=True)  # force: SIGKILL a running one
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            if exc.status_code in (404, 409):  # gone, or its removal already in progress
                return
            raise PlatformError(f"cannot remove container {container.name}: {exc}") from exc

    def _stop(self, component: str) -> None:
        container = self._container(component)
        if container is not None:
            self._remove(container)

    def start(self, images: PlatformImages) -> None:
        """Start the platform from ``images``: the control plane (waited healthy: the agent and
        the bridge read the token files it writes), the agent, the bridge. Leftover containers of
        the same names are replaced. Raises :class:`PlatformError` when dockerd refuses or the
        control plane does not become healthy in 120 s."""
        self.home.mkdir(parents=True, exist_ok=True)
        if self.cluster_config is not None:
            shutil.copyfile(self.cluster_config, self.home / "cluster.yaml")
        self.replace("control-plane", images.control_plane)
        health = self.gate_healthz(120)
        if not health.ok:
            raise PlatformError(f"platform {self.name}: the control plane did not start: {health.detail}")
        for component in self.components[1:]:
            self.replace(component, images.for_component(component))

    def replace(self, component: str, image: str) -> None:
        """Stop and remove ``component``'s container (if any) and start it from ``image`` with the
        same arguments. Idempotent (a second call replaces it again); blocks for the stop (at
        most ~10 s) and a pull of a missing image."""
        if component not in self.components:
            raise ValueError(f"platform {self.name} has no component {component!r}; it has {self.components}")
        self._stop(component)
        self._run(component, image)

    def current_images(self) -> dict[str, str]:
        """Image key (``control-plane``, ``agent``, ``prefect``) -> the image name each existing
        component container was started from (label ``apiary.image``)."""
        out: dict[str, str] = {}
        for c in self.client.containers.list(all=True, filters={"label": f"{PLATFORM_LABEL}={self.name}"}):
            component = c.labels.get(COMPONENT_LABEL)
            if component in COMPONENT_IMAGE and IMAGE_LABEL in c.labels:
                out[COMPONENT_IMAGE[component]] = c.labels[IMAGE_LABEL]
        return out

    def logs(self, component: str, tail: int = 100) -> str:
        """The last ``tail`` lines of the component's container log ("" when it has none)."""
        import docker

        container = self._container(component)
        if container is None:
            return ""
        try:
            return bytes(container.logs(tail=tail)).decode(errors="replace")
        except docker.errors.DockerException:
            return ""

    def teardown(self) -> list[str]:
        """Remove every container of this platform: its components (the agent first, so it does not
        restart tasks), then the task containers the docker runtime started for it (label
        ``apiary.cluster=<cluster id>``). Never raises for what is already gone; returns the names
        removed. ``home`` is left as it is (the caller owns it)."""
        import docker

        removed: list[str] = []
        own = self.client.containers.list(all=True, filters={"label": f"{PLATFORM_LABEL}={self.name}"})
        own.sort(key=lambda c: c.labels.get(COMPONENT_LABEL) != "agent")
        tasks: list[Any] = []
        cluster = self.cluster_id()
        if cluster:
            tasks = self.client.containers.list(all=True, filters={"label": f"{CLUSTER_LABEL}={cluster}"})
        for c in [*own, *tasks]:
            try:
                c.remove(force=True)
                removed.append(c.name)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as exc:
                if exc.status_code not in (404, 409):
                    logger.warning("platform=%s container %s not removed: %s", self.name, c.name, exc)
        logger.info("platform=%s torn down: %s", self.name, ", ".join(removed) or "nothing")
        return removed

    # -- gates -------------------------------------------------------------------------------

    def _exited(self, component: str) -> str | None:
        """None while ``component``'s container runs; else why not, with its log's tail."""
        container = self._container(component)
        if container is None:
            return f"container {self.container_name(component)} does not exist"
        status = container.status
        if status in ("created", "running", "restarting", "paused"):
            return None
        code = (container.attrs.get("State") or {}).get("ExitCode")
        tail = self.logs(component, 30).strip()
        return f"container {container.name} {status} (exit code {code}); log tail:\n{tail[-3000:]}"

    def _poll(self, gate: str, timeout_s: float, check: Callable[[], tuple[bool | None, str]],
              poll_s: float = 0.5) -> GateResult:
        """Run ``check`` until it answers ``(True, detail)`` (ok), ``(False, detail)`` (failed at
        once) or ``timeout_s`` passes while it answers ``(None, detail)`` (not yet)."""
        t0 = time.monotonic()
        detail = "not checked"
        while True:
            try:
                verdict, detail = check()
            except (ApiaryError, httpx.HTTPError, OSError) as exc:
                verdict, detail = None, f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # docker.errors.DockerException: dockerd itself answers badly
                verdict, detail = None, f"{type(exc).__name__}: {exc}"
            if verdict is not None:
                return GateResult(verdict, gate, detail, time.monotonic() - t0)
            if time.monotonic() - t0 >= timeout_s:
                return GateResult(False, gate, f"timed out after {timeout_s:.0f} s: {detail}", time.monotonic() - t0)
            time.sleep(poll_s)

    def gate_healthz(self, timeout_s: float = 120) -> GateResult:
        """``GET /healthz`` answers 200 with this home's cluster id, and the control plane's
        container is running (an exited one fails at once, with its log's tail)."""

        def check() -> tuple[bool | None, str]:
            exited = self._exited("control-plane")
            if exited:
                return False, exited
            r = httpx.get(f"{self.url}/healthz", timeout=2)
            if r.status_code != 200:
                return None, f"/healthz answered {r.status_code}"
            answered, expected = r.json().get("clusterId"), self.cluster_id()
            if expected and answered != expected:
                return None, f"/healthz answers cluster {answered}, not this home's {expected} (port taken?)"
            return True, f"/healthz 200 at {self.url}"

        return self._poll("healthz", timeout_s, check)

    def gate_agents(self, timeout_s: float = 120) -> GateResult:
        """Every node of the cluster is ready and its agent reported after the gate began (a
        replaced agent really reports, not the old one's stale state), and the agent's container
        is running."""
        started = time.time()

        def check() -> tuple[bool | None, str]:
            exited = self._exited("agent")
            if exited:
                return False, exited
            with closing(self._api(timeout=5)) as api:
                nodes = api.nodes()
            stale = [n["name"] for n in nodes if not n["ready"] or _parse_iso(n.get("lastHeartbeat")) < started]
            if not nodes:
                return None, "the cluster has no nodes"
            if stale:
                return None, f"{len(stale)}/{len(nodes)} nodes not ready yet: {', '.join(sorted(stale)[:10])}"
            return True, f"{len(nodes)} nodes ready"

        return self._poll("agents", timeout_s, check)

    def gate_bridge(self, timeout_s: float = 60, settle_s: float = 3.0) -> GateResult:
        """The bridge's container is still running ``settle_s`` after the gate began (it exits at
        once on a bad URL or token) and, once its state file exists, it is readable JSON. The
        bridge serves no health endpoint; it backs off while Prefect is down, so Prefect's own
        health is reported in the detail but does not fail the gate."""
        t0 = time.monotonic()

        def check() -> tuple[bool | None, str]:
            exited = self._exited("bridge")
            if exited:
                return False, exited
            if time.monotonic() - t0 < min(settle_s, timeout_s):
                return None, "settling"
            state = self.home / "prefect-bridge.json"
            if state.exists():
                import json

                json.loads(state.read_text(encoding="utf-8"))
            try:
                prefect = httpx.get(f"{self.prefect_api_url}/health", timeout=2).status_code
                seen = f"Prefect /health {prefect}"
            except httpx.HTTPError as exc:
                seen = f"Prefect not reachable ({type(exc).__name__})"
            return True, f"bridge running after {settle_s:.0f} s; {seen}"

        return self._poll("bridge", max(timeout_s, settle_s + 1), check, poll_s=0.25)

    def gate_canary(self, timeout_s: float, job_yaml: str) -> GateResult:
        """Submit ``job_yaml`` (an OpenPAI job; its name gets a unique suffix so every canary is a
        new job) as the admin and wait for SUCCEEDED. A canary still unfinished at the deadline is
        stopped."""
        import yaml

        t0 = time.monotonic()
        job_id = None
        try:
            doc = yaml.safe_load(job_yaml)
            doc["name"] = f"{doc.get('name', 'canary')}-{uuid.uuid4().hex[:8]}"
            with closing(self._api(timeout=10)) as api:
                job_id = api.submit(yaml.safe_dump(doc, sort_keys=False))["id"]
                try:
                    final = api.wait(job_id, timeout=timeout_s, poll_s=0.5)
                except TimeoutError:
                    final = api.get(job_id)
                    api.stop(job_id)
        except (ApiaryError, httpx.HTTPError, OSError, yaml.YAMLError, TypeError) as exc:
            return GateResult(False, "canary", f"canary {job_id or '(not submitted)'}: {type(exc).__name__}: {exc}",
                              time.monotonic() - t0)
        ok = final["state"] == "SUCCEEDED"
        detail = f"canary {job_id} {final['state']}"
        if not ok:
            codes = [t.get("exitCode") for t in final.get("tasks", [])]
            detail += f" (exit codes {codes}; waiting: {final.get('waitingReason') or '-'})"
        return GateResult(ok, "canary", detail, time.monotonic() - t0)


def _parse_iso(text: str | None) -> float:
    """Unix seconds of the API's ``2023-11-14T22:13:22.000Z``; 0 for None."""
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
