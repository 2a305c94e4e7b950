"""The pipeline's configuration, from the environment of the process that runs the CI flows.

=================================  ==========================================================
variable                           meaning (default)
=================================  ==========================================================
``APIARY_CI_REPO_URL``             clone from here instead of the webhook's ``clone_url``
                                   (a mirror, or the local bare repository in tests)
``APIARY_CI_REGISTRY``             registry ``host:port`` the images are pushed to (required
                                   by the image stage)
``APIARY_CI_PROFILE``              ``full`` (``make lint test-fast`` whole) or ``reduced``
                                   (only ``APIARY_CI_UNIT_PATHS``) (``full``)
``APIARY_CI_UNIT_PATHS``           reduced profile: the test paths the unit stage runs
``APIARY_CI_WORKDIR``              workspaces and staging homes (``~/.apiary/ci-work``)
``APIARY_CI_ARTIFACTS``            artifacts, one folder per flow run (``~/.apiary/ci-artifacts``)
``APIARY_CI_STATUS_URL``           where the commit status is POSTed; ``{repo}`` and ``{sha}``
                                   are filled in (GitHub: ``https://api.github.com/repos/{repo}
                                   /statuses/{sha}``); unset: no status is posted
``APIARY_CI_STATUS_TOKEN``         bearer token for that URL
``APIARY_CI_CONTEXT``              the status's ``context`` (``apiary/platform-ci``)
``APIARY_CI_RECORD_URL``           the Apiary control plane that records runs and deployments
                                   (``APIARY_API_URL``); ``APIARY_CI_RECORD_TOKEN``
                                   (``APIARY_TOKEN``) an admin token there
``APIARY_CI_PRODUCTION``           YAML describing the production platform the deploy flow rolls
                                   (:class:`ProductionTarget`); unset: no deploy
``APIARY_CI_VENV``                 the virtualenv the unit and regression stages run with (this
                                   process's)
``PREFECT_UI_URL``                 to build the status's ``target_url`` (the flow run's page;
                                   default: ``PREFECT_API_URL`` without ``/api``)
=================================  ==========================================================
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from apiary.errors import ValidationError

#: The reduced profile's unit tests: the pure core's suites (spec, lifecycle, scheduler), about a
#: minute on 2 cores. The full profile runs `make test-fast` whole.
REDUCED_UNIT_PATHS = ("tests/spec", "tests/lifecycle")
#: The chaos experiments the pipeline runs, in both profiles (files in chaos/ tagged ``ci`` that need
#: only the API: a containerised staging platform has no pids on this host to kill).
CI_CHAOS = ("gpu-faults",)


def _ui_from_api(env: dict[str, str]) -> str | None:
    """The Prefect UI of ``PREFECT_API_URL`` (``http://h:4200/api`` -> ``http://h:4200``, where the
    self-hosted server serves both), for the commit status's link when ``PREFECT_UI_URL`` is unset."""
    api = env.get("PREFECT_API_URL", "").rstrip("/")
    return api[: -len("/api")] if api.endswith("/api") else None


@dataclass(frozen=True)
class ProductionTarget:
    """The production platform the deploy flow rolls forward: a :class:`apiary.ci.containers.
    ContainerPlatform` named ``name`` with its ``home`` and ``port``; ``agent_runtime`` (``docker``
    so that running tasks survive an agent's replacement), the ``registry``, ``prefect_api_url``
    (the bridge's Prefect; None: no bridge) and ``canary_job`` (a job YAML file; None: Lab 6's
    job-config-0)."""

    name: str
    home: Path
    port: int
    registry: str | None = None
    agent_runtime: str = "docker"
    prefect_api_url: str | None = None
    image_map: Path | None = None
    canary_job: Path | None = None
    gate_timeout_s: float = 180.0

    @classmethod
    def load(cls, path: Path) -> ProductionTarget:
        """From a YAML mapping with these keys; raises ValidationError naming a bad field."""
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValidationError("APIARY_CI_PRODUCTION", f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValidationError("APIARY_CI_PRODUCTION", "must be a mapping")
        for key in ("name", "home", "port"):
            if key not in raw:
                raise ValidationError(key, f"missing in {path}")
        try:
            return cls(name=str(raw["name"]), home=Path(raw["home"]), port=int(raw["port"]),
                       registry=raw.get("registry"), agent_runtime=str(raw.get("agent_runtime", "docker")),
                       prefect_api_url=raw.get("prefect_api_url"),
                       image_map=Path(raw["image_map"]) if raw.get("image_map") else None,
                       canary_job=Path(raw["canary_job"]) if raw.get("canary_job") else None,
                       gate_timeout_s=float(raw.get("gate_timeout_s", 180.0)))
        except (TypeError, ValueError) as exc:
            raise ValidationError("APIARY_CI_PRODUCTION", f"{path}: {exc}") from exc

    def dump(self, path: Path) -> None:
        data: dict[str, Any] = {"name": self.name, "home": str(self.home), "port": self.port,
                                "registry": self.registry, "agent_runtime": self.agent_runtime,
                                "prefect_api_url": self.prefect_api_url, "gate_timeout_s": self.gate_timeout_s}
        if self.image_map:
            data["image_map"] = str(self.image_map)
        if self.canary_job:
            data["canary_job"] = str(self.canary_job)
        Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


@dataclass(frozen=True)
class CiConfig:
    """See the module docstring for each field's variable."""

    repo_url: str | None = None
    registry: str | None = None
    profile: str = "full"
    unit_paths: tuple[str, ...] = REDUCED_UNIT_PATHS
    chaos: tuple[str, ...] = CI_CHAOS
    workdir: Path = field(default_factory=lambda: Path.home() / ".apiary" / "ci-work")
    artifacts: Path = field(default_factory=lambda: Path.home() / ".apiary" / "ci-artifacts")
    status_url: str | None = None
    status_token: str | None = None
    context: str = "apiary/platform-ci"
    record_url: str | None = None
    record_token: str | None = None
    production: ProductionTarget | None = None
    venv: Path = field(default_factory=lambda: Path(sys.prefix))
    ui_url: str | None = None

    @property
    def reduced(self) -> bool:
        return self.profile == "reduced"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> CiConfig:
        """Read the variables; raises ValidationError naming a bad one."""
        e = dict(os.environ if env is None else env)
        profile = e.get("APIARY_CI_PROFILE", "full")
        if profile not in ("full", "reduced"):
            raise ValidationError("APIARY_CI_PROFILE", f"must be full or reduced, not {profile!r}")
        home = Path.home() / ".apiary"
        paths = tuple(p for p in e.get("APIARY_CI_UNIT_PATHS", "").split(",") if p.strip()) or REDUCED_UNIT_PATHS
        production = e.get("APIARY_CI_PRODUCTION")
        return cls(
            repo_url=e.get("APIARY_CI_REPO_URL") or None, registry=e.get("APIARY_CI_REGISTRY") or None,
            profile=profile, unit_paths=paths, chaos=CI_CHAOS,
            workdir=Path(e.get("APIARY_CI_WORKDIR") or home / "ci-work"),
            artifacts=Path(e.get("APIARY_CI_ARTIFACTS") or home / "ci-artifacts"),
            status_url=e.get("APIARY_CI_STATUS_URL") or None, status_token=e.get("APIARY_CI_STATUS_TOKEN") or None,
            context=e.get("APIARY_CI_CONTEXT") or "apiary/platform-ci",
            record_url=e.get("APIARY_CI_RECORD_URL") or e.get("APIARY_API_URL") or None,
            record_token=e.get("APIARY_CI_RECORD_TOKEN") or e.get("APIARY_TOKEN") or None,
            production=ProductionTarget.load(Path(production)) if production else None,
            venv=Path(e.get("APIARY_CI_VENV") or sys.prefix), ui_url=e.get("PREFECT_UI_URL") or _ui_from_api(e),
        )
