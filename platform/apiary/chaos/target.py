"""The platform an experiment addresses, from its chaostoolkit configuration, and what the
experiment's activities share within one ``chaos run`` (the jobs it got accepted, its state files).

Configuration keys (each falls back to the environment, then to the platform home):

==================== ===================== =====================================================
key                  environment           meaning
==================== ===================== =====================================================
``apiary_url``       ``APIARY_API_URL``    the control plane (default: ``home/run/api_url``)
``apiary_token``     ``APIARY_TOKEN``      an admin's token (default: the file ``home/token``)
``apiary_home``      ``APIARY_HOME``       the platform home: run files, pids, the store's disk
``apiary_probe_vc``  ``APIARY_CHAOS_VC``   virtual cluster of probe jobs (default ``default``)
``apiary_probe_slo`` ``APIARY_CHAOS_SLO_S`` seconds a probe job may take, submit to SUCCEEDED (60)
==================== ===================== =====================================================

The token is never written to the journal: experiments declare it as ``{"type": "env", "key":
"APIARY_TOKEN"}`` and chaostoolkit keeps only that declaration.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from apiary.auth.bootstrap import read_token
from apiary.client import ApiaryClient
from apiary.errors import ValidationError

logger = logging.getLogger(__name__)

DEFAULT_VC = "default"
DEFAULT_SLO_S = 60.0
#: The environment variable naming a file where the runner wants the accepted jobs written (one id a line).
LEDGER_ENV = "APIARY_CHAOS_LEDGER"


@dataclass(frozen=True)
class Target:
    """Where the platform is. ``home`` is None when neither configuration nor environment names one
    (the actions that need pids or files then refuse, naming ``apiary_home``)."""

    api_url: str
    token: str | None
    home: Path | None
    probe_vc: str = DEFAULT_VC
    probe_slo_s: float = DEFAULT_SLO_S

    @classmethod
    def of(cls, configuration: Mapping[str, Any] | None) -> Target:
        """The target of an activity's ``configuration`` (chaostoolkit passes it resolved)."""
        c = dict(configuration or {})

        def pick(key: str, env: str) -> str | None:
            value = c.get(key)
            if value in (None, ""):
                value = os.environ.get(env) or None
            return None if value is None else str(value)

        home_s = pick("apiary_home", "APIARY_HOME")
        home = Path(home_s).expanduser().resolve() if home_s else None
        url = pick("apiary_url", "APIARY_API_URL")
        if url is None and home is not None and (home / "run" / "api_url").exists():
            url = (home / "run" / "api_url").read_text().strip()
        if not url:
            raise ValidationError("apiary_url", "no platform: set APIARY_API_URL, or APIARY_HOME of a running one")
        token = pick("apiary_token", "APIARY_TOKEN")
        if token is None and home is not None:
            token = read_token(home / "token")
        slo = pick("apiary_probe_slo", "APIARY_CHAOS_SLO_S")
        return cls(api_url=url.rstrip("/"), token=token, home=home,
                   probe_vc=pick("apiary_probe_vc", "APIARY_CHAOS_VC") or DEFAULT_VC,
                   probe_slo_s=float(slo) if slo else DEFAULT_SLO_S)

    def client(self, timeout: float = 30.0) -> ApiaryClient:
        return ApiaryClient(self.api_url, timeout=timeout, token=self.token)

    def need_home(self) -> Path:
        if self.home is None:
            raise ValidationError("apiary_home", "this activity needs the platform home: set APIARY_HOME")
        return self.home

    def state_dir(self) -> Path:
        """``home/run/chaos``: what an action leaves for its undo (frozen pids, fill files, netns
        resources), so an operator can finish a rollback by hand after a crash."""
        d = self.need_home() / "run" / "chaos"
        d.mkdir(parents=True, exist_ok=True)
        return d


# ------------------------------------------------------------------------------ shared state
_lock = threading.Lock()
_accepted: list[str] = []


def record_accepted(job_id: str) -> None:
    """Remember a job the platform accepted (202) during this run, for ``no_accepted_job_lost`` and
    ``no_task_ran_twice``; also appended to the runner's ledger file when it asked for one."""
    with _lock:
        _accepted.append(job_id)
    path = os.environ.get(LEDGER_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(job_id + "\n")


def accepted_jobs() -> list[str]:
    with _lock:
        return list(_accepted)


def save_state(target: Target, name: str, doc: dict) -> Path:
    path = target.state_dir() / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def load_state(target: Target, name: str) -> dict | None:
    path = target.state_dir() / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def drop_state(target: Target, name: str) -> None:
    (target.state_dir() / f"{name}.json").unlink(missing_ok=True)


# ------------------------------------------------------------------------------ jobs
def unique_name(prefix: str) -> str:
    """``<prefix>-<8 hex>``: job names never repeat across runs on one platform."""
    return f"{prefix}-{secrets.token_hex(4)}"


def job_text(name: str, vc: str, commands: list[str], *, priority: str = "prod", gpu: int = 1,
             retries: int = 0, role: str = "probe") -> str:
    """A one-instance OpenPAI v2 job (YAML) for the process runtime."""
    doc = {
        "protocolVersion": 2,
        "name": name,
        "type": "job",
        "jobRetryCount": retries,
        "prerequisites": [{"protocolVersion": 2, "name": "image-0", "type": "dockerimage", "uri": "python:3.11"}],
        "taskRoles": {role: {
            "instances": 1,
            "dockerImage": "image-0",
            "resourcePerInstance": {"gpu": gpu, "cpu": 1, "memoryMB": 512},
            "commands": list(commands),
        }},
        "defaults": {"virtualCluster": vc},
        "extras": {"hivedScheduler": {"jobPriorityClass": priority}},
    }
    return yaml.safe_dump(doc, sort_keys=False)
