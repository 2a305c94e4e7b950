"""What every drill shares: its settings, its client of the API, its outcome and how it is reported.

Who a drill acts as: the drills cordon nodes, read every VC and report results, so they act as the
platform admin: ``APIARY_DRILL_TOKEN``, else the admin's ``APIARY_HOME/token`` (``apiary up``
writes it; its Prefect children share the home), else ``APIARY_TOKEN``. With a service token
(the Prefect bridge's) the probe and benchmark jobs are submitted on behalf of
``APIARY_DRILL_USER``; node cordons then fail with 403 and the report says so. The token is sent
only to the platform's configured URL (:meth:`DrillApi.from_env`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from apiary.client import ApiaryClient
from apiary.errors import ApiaryError

logger = logging.getLogger(__name__)

Result = Literal["passed", "failed", "aborted"]
#: The drills' names: the Prefect flows, the ``drill`` label of ``apiary_drill_*``.
DRILLS = ("inspection", "stress-drill", "chaos-drill", "load-drill")
#: A job image every runtime can start: the process runtime ignores it; the Docker runtime's image
#: map sends OpenPAI's standard images to Apiary's python image (NumPy, examples/).
DEFAULT_IMAGE = "openpai/standard:python_3.6-pytorch_1.2.0-gpu"


class DrillSettings(BaseSettings):
    """The drills' settings (environment ``APIARY_DRILL_*``); flow parameters override them."""

    model_config = SettingsConfigDict(env_prefix="APIARY_DRILL_", extra="ignore")

    token: str | None = Field(default=None, description="Bearer token of the drills; default the admin's "
                                                        "APIARY_HOME/token, then APIARY_TOKEN.")
    user: str = Field(default="admin", description="User the drill jobs run as when the token is a service's "
                                                   "(submitted on their behalf).")
    image: str = Field(default=DEFAULT_IMAGE, description="Image of the probe and benchmark jobs.")
    probe_slo_s: float = Field(default=120.0, gt=0, description="Inspection probe SLO: submit to succeeded, "
                                                                "seconds.")
    stress_timeout_s: float = Field(default=900.0, gt=0, description="How long the stress drill waits for its "
                                                                     "benchmark jobs, seconds.")
    stress_cordon: bool = Field(default=True, description="Cordon the nodes the stress drill's diagnosis fails.")
    rules: Path | None = Field(default=None, description="Diagnosis rules (YAML); default the packaged "
                                                         "apiary/drills/rules.yaml.")
    guard_max_probe_failures: int = Field(default=2, ge=0, description="Error budget of a live drill: inspection "
                                                                      "probe rounds that may fail before it aborts.")
    guard_interval_s: float = Field(default=30.0, gt=0, description="Seconds between the guard's probe rounds.")
    guard_probe_slo_s: float = Field(default=60.0, gt=0, description="The guard's probe SLO, seconds.")


def drill_token(settings: DrillSettings | None = None) -> str | None:
    """The drills' token (module doc): ``APIARY_DRILL_TOKEN``, the admin's home token, ``APIARY_TOKEN``."""
    from apiary.auth.bootstrap import read_token
    from apiary.settings import Settings

    settings = settings or DrillSettings()
    if settings.token:
        return settings.token.strip()
    base = Settings()
    return read_token(base.token_path) or base.resolved_token()


class DrillApi(ApiaryClient):
    """:class:`~apiary.client.ApiaryClient` plus what drills do: submit as the drill's user, inject
    faults, report results. Errors are the client's (``apiary.errors`` classes)."""

    def __init__(self, api_url: str, token: str | None, *, user: str = "admin", timeout: float = 30.0) -> None:
        super().__init__(api_url, timeout=timeout, token=token)
        self.token = token  # the chaos and load runners act with it too
        self.user = user
        self._me: dict | None = None

    @classmethod
    def from_env(cls, api_url: str | None = None, settings: DrillSettings | None = None) -> DrillApi:
        """A client with the drills' token (:func:`drill_token`) of the platform's configured URL
        (:func:`apiary.tracking.submit.platform_api_url`), or of ``api_url`` when a trusted caller on
        the host names one (``python -m apiary.drills --api``). The Prefect flows never pass
        ``api_url``: a run parameter would send the admin's token wherever the run's starter chose."""
        from apiary.tracking.submit import resolve_api_url

        settings = settings or DrillSettings()
        return cls(resolve_api_url(api_url), drill_token(settings), user=settings.user)

    def identity(self) -> dict:
        if self._me is None:
            self._me = self.me()
        return self._me

    def submit_job(self, text: str) -> dict:
        """Submit a drill job: as the token's user, or on behalf of :attr:`user` with a service token."""
        if self.identity().get("kind") == "service":
            return self.submit(text, on_behalf_of=self.user)
        return self.submit(text)

    def report(self, report: dict[str, Any]) -> dict:
        """``POST /api/v2/drills/results`` (``DrillReport``)."""
        return self._call("POST", "/api/v2/drills/results", json=report).json()

    def drill_results(self) -> dict:
        return self._call("GET", "/api/v2/drills").json()

    def inject_fault(self, node: str, gpu: int, **kinds: Any) -> dict:
        """``POST /api/v2/nodes/{node}/faults`` with camelCase kinds (``degraded=3.0``, ``clear=True``)."""
        return self._call("POST", f"/api/v2/nodes/{node}/faults", json={"gpu": gpu, **kinds}).json()


@dataclass
class DrillOutcome:
    """A drill run: its result, a one-line summary, the rows of its table artifact, and markdown
    artifacts (plots) by title. ``report`` holds what was sent to the control plane."""

    drill: str
    result: Result
    summary: str
    started_at: float
    finished_at: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    plots: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.result == "passed"

    def wire(self, **extra: Any) -> dict[str, Any]:
        """The ``DrillReport`` body of this outcome (``extra``: ``probes``, ``nodeFailures``)."""
        return {"drill": self.drill, "result": self.result, "startedAt": self.started_at,
                "finishedAt": self.finished_at, "summary": self.summary[:4000], **extra}


def record(api: DrillApi, outcome: DrillOutcome, **extra: Any) -> DrillOutcome:
    """Report ``outcome`` to the control plane; a refused or failed report is logged and kept in
    ``outcome.details["reportError"]`` (the drill's own result stands)."""
    outcome.report = outcome.wire(**extra)
    try:
        api.report(outcome.report)
    except ApiaryError as e:
        logger.error("drill=%s result not recorded: %s", outcome.drill, e.message)
        outcome.details["reportError"] = e.message
    return outcome


def unique_suffix(clock: Callable[[], float] = time.time) -> str:
    """``20261125T101500-1a2b``: a UTC time stamp and 4 hex digits of its fraction, for job names."""
    now = clock()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"-{int((now % 1) * 65536):04x}"


def drill_job(name: str, vc: str, *, image: str, commands: list[str], gpu: int = 1, sku: str | None = None,
              cpu: int = 1, memory_mb: int = 512, role: str = "main") -> str:
    """An opportunistic (``oppo``) one-task OpenPAI job: it runs only on idle cells and is the first
    to be preempted, so it never delays a guaranteed job."""
    import yaml

    hived: dict[str, Any] = {"jobPriorityClass": "oppo"}
    if sku is not None:
        hived["taskRoles"] = {role: {"skuType": sku}}
    return yaml.safe_dump({
        "protocolVersion": 2, "name": name, "type": "job",
        "prerequisites": [{"protocolVersion": 2, "name": "image", "type": "dockerimage", "uri": image}],
        "taskRoles": {role: {"instances": 1, "dockerImage": "image",
                             "resourcePerInstance": {"cpu": cpu, "memoryMB": memory_mb, "gpu": gpu},
                             "commands": commands}},
        "defaults": {"virtualCluster": vc},
        "extras": {"hivedScheduler": hived},
    }, sort_keys=False)


def parse_iso(text: str | None) -> float | None:
    """Unix seconds of the API's ``2023-11-14T22:13:22.000Z`` (None stays None)."""
    if not text:
        return None
    import calendar

    base, _, frac = text.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S")) + (float(f"0.{frac}") if frac else 0.0)
