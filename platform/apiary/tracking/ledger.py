"""The bridge's run-link keeper: its state file, with the cursor and one record per job.

``state_path`` (JSON, replaced atomically) holds ``{"version": 2, "cursor": int, "jobs": {job id:
record}, "artifacts": [...]}``: every event with ``seq <= cursor`` is mirrored; a job's record
holds the last seq done (``lastSeq``), its flow run id (``flowRunId``), whether the bridge made
that run (``owned``; False for a run a flow engine runs, e.g. from the Prefect form), its open
task runs, log offsets and the state it should show (``want``). A finished job shrinks to a
tombstone (:meth:`Ledger.prune`) that keeps its run id and final state, so a restarted bridge
still knows every run it linked and how each must end.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from apiary.errors import ApiaryError

__all__ = ["STATE_VERSION", "Ledger", "suffix"]

STATE_VERSION = 2


def suffix(attempt: int) -> str:
    """The task run name suffix of attempt ``attempt``: ``""`` for 0, ``"@N"`` after."""
    return f"@{attempt}" if attempt else ""


class Ledger:
    """The state file at ``path``, loaded at construction (a missing file is an empty ledger).

    Raises :class:`~apiary.errors.ApiaryError` for a file of an unknown version; reads version 1
    files (open task runs as bare ids) as version 2.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = self._load()

    @property
    def cursor(self) -> int:
        """Seq of the last event done; every event with a smaller or equal seq is mirrored."""
        return int(self.data["cursor"])

    @cursor.setter
    def cursor(self, seq: int) -> None:
        self.data["cursor"] = int(seq)

    @property
    def jobs(self) -> dict[str, dict[str, Any]]:
        """Job id -> its record (mutable; saved by :meth:`save`)."""
        jobs: dict[str, dict[str, Any]] = self.data["jobs"]
        return jobs

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"version": STATE_VERSION, "cursor": 0, "jobs": {}}
        if data.get("version") == 1:  # open task runs were bare ids; a job's "submitted" was implied
            for job in data.get("jobs", {}).values():
                job["open"] = {k: _v1_open(k, v) for k, v in (job.get("open") or {}).items()}
                if job.get("flowRunId"):
                    job.setdefault("submitted", {})
            data["version"] = STATE_VERSION
        if data.get("version") != STATE_VERSION:
            raise ApiaryError(f"bridge state {self.path} has version={data.get('version')}")
        return dict(data)

    def save(self) -> None:
        """Write the ledger atomically (readers see the old or the new file, never a mix)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".bridge-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.data, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def job(self, job_id: str) -> dict[str, Any]:
        """The record of ``job_id``, made empty if the ledger has none."""
        return self.jobs.setdefault(
            job_id,
            {
                "flowRunId": None,
                "owned": True,
                "lastSeq": 0,
                "done": False,
                "running": False,
                "open": {},
                "inst": {},
                "logOff": {},
                "user": None,
            },
        )

    def snapshot(self, job_ids: set[str] | list[str]) -> dict[str, str | None]:
        """The records of ``job_ids`` as they are now (None: no record), for :meth:`restore`."""
        return {j: (json.dumps(self.jobs[j]) if j in self.jobs else None) for j in job_ids}

    def restore(self, before: dict[str, str | None]) -> None:
        """Put back records :meth:`snapshot` took (a batch whose writes failed is redone)."""
        for job_id, old in before.items():
            if old is None:
                self.jobs.pop(job_id, None)
            else:
                self.jobs[job_id] = json.loads(old)

    def prune(self) -> None:
        """Finished jobs whose events are all behind the cursor, with nothing left to write, shrink
        to a tombstone: run id, last seq, owner and final state (what a restart needs)."""
        for job_id, job in self.jobs.items():
            if (job.get("done") and job["lastSeq"] <= self.cursor and "inst" in job and not job.get("want")
                    and not job.get("settle")):
                self.jobs[job_id] = {
                    "flowRunId": job["flowRunId"],
                    "lastSeq": job["lastSeq"],
                    "done": True,
                    "owned": job.get("owned", True),
                    "final": job.get("final"),
                }

    def queue_artifact(self, artifact: dict[str, Any]) -> None:
        """Keep a summary artifact (``ArtifactCreate`` JSON with its ``flow_run_id``) until sent."""
        self.data.setdefault("artifacts", []).append(artifact)

    def artifacts(self, most: int) -> list[dict[str, Any]]:
        """The first ``most`` queued artifacts (still queued until :meth:`drop_artifacts`)."""
        return list((self.data.get("artifacts") or [])[:most])

    def drop_artifacts(self, n: int) -> None:
        """Forget the first ``n`` queued artifacts (sent, or refused for good)."""
        del self.data.setdefault("artifacts", [])[:n]


def _v1_open(key: str, task_run: str) -> dict[str, Any]:
    """An open task run of a version 1 state file (``key`` ``queue:<attempt>`` or
    ``run:<role>:<attempt>`` -> its id) as version 2 records it. The name is the one it was created
    with; its start time was not kept, so its end is recorded as its start."""
    parts = key.split(":")
    attempt = int(parts[-1])
    name = "queue" if parts[0] == "queue" else f"run-{parts[1]}"
    return {"id": task_run, "name": name + suffix(attempt), "dynamicKey": key, "attempt": attempt}
