"""The bridge's run-link keeper: its state file, with the cursor and one record per job.

``state_path`` (JSON, replaced atomically) holds ``{"version": 2, "cursor": int, "jobs": {job id:
record}, "artifacts": [...]}``: every event with ``seq <= cursor`` is mirrored; a job's record
holds the last seq done (``lastSeq``), its flow run id (``flowRunId``), whether the bridge made
that run (``owned``; False for a run a flow engine runs, e.g. from the Prefect form), its open
task runs, log offsets and the state it should show (``want``). A finished job shrinks to a
tombstone (:meth:`Ledger.prune`) that keeps its run id and final state, so a restarted bridge
still knows every run it linked and how each must end.

Tombstones live beside the state file, in ``<state_path>.tombs`` (JSON lines, one tombstone
each, appended once when a job is pruned), so that a save writes the jobs still live, not every
job the bridge ever mirrored: saved after every batch, a file of all of them cost the bridge half
its CPU at 20 jobs/s after 1,200 jobs (py-spy) and grew with the platform's age. A record in the
state file wins over a tombstone of the same job (the tombstone was appended, the state file not
yet replaced, when the bridge stopped: the job's events are done again from the cursor).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from apiary.errors import ApiaryError
from apiary.procutil import replace_file

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
        self.tombs_path = self.path.with_name(self.path.name + ".tombs")
        self.tombs: dict[str, dict[str, Any]] = {}  # job id -> tombstone, of jobs not in ``jobs``
        self._unsaved_tombs: list[str] = []
        self.data: dict[str, Any] = self._load()
        self._load_tombs()

    @property
    def cursor(self) -> int:
        """Seq of the last event done; every event with a smaller or equal seq is mirrored."""
        return int(self.data["cursor"])

    @cursor.setter
    def cursor(self, seq: int) -> None:
        self.data["cursor"] = int(seq)

    @property
    def jobs(self) -> dict[str, dict[str, Any]]:
        """Job id -> its record, for the jobs not pruned to a tombstone (mutable; saved by
        :meth:`save`)."""
        jobs: dict[str, dict[str, Any]] = self.data["jobs"]
        return jobs

    def by_flow_run(self) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        """Flow run id -> the jobs (id, record or tombstone) linked to it, tombstones first."""
        out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for jobs in (self.tombs, self.jobs):
            for job_id, job in jobs.items():
                if job.get("flowRunId"):
                    out.setdefault(job["flowRunId"], []).append((job_id, job))
        return out

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

    def _load_tombs(self) -> None:
        """Read ``<state>.tombs`` (later lines win; a torn last line, from a stop mid-append, is
        skipped) and rewrite it when it holds repeats; tombstones of jobs the state file still
        has live are dropped. Tombstones an older state file kept among its jobs move there."""
        lines = 0
        try:
            with open(self.tombs_path) as f:
                for line in f:
                    lines += 1
                    try:
                        job_id, tomb = json.loads(line)
                    except ValueError:
                        continue
                    self.tombs[str(job_id)] = tomb
        except FileNotFoundError:
            pass
        for job_id in self.jobs:
            self.tombs.pop(job_id, None)
        for job_id, job in list(self.jobs.items()):
            if job.get("done") and "inst" not in job:  # a tombstone kept in the state file
                self.tombs[job_id] = self.jobs.pop(job_id)
                self._unsaved_tombs.append(job_id)
        if lines > len(self.tombs):
            self._rewrite_tombs()

    def _rewrite_tombs(self) -> None:
        text = "".join(json.dumps([j, t], separators=(",", ":")) + "\n" for j, t in self.tombs.items())
        replace_file(self.tombs_path, text)
        self._unsaved_tombs = []

    def save(self) -> None:
        """Write the ledger: new tombstones appended to ``<state>.tombs``, then the state file
        replaced atomically (readers see the old or the new file, never a mix). Both are fsynced.
        Raises OSError when the directory cannot be written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._unsaved_tombs:
            text = "".join(
                json.dumps([j, self.tombs[j]], separators=(",", ":")) + "\n"
                for j in self._unsaved_tombs if j in self.tombs
            )
            with open(self.tombs_path, "a") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            self._unsaved_tombs = []
        # json.dumps, not json.dump: dump streams through the pure-Python encoder, ~10x slower.
        replace_file(self.path, json.dumps(self.data, separators=(",", ":")))

    def job(self, job_id: str) -> dict[str, Any]:
        """The record of ``job_id`` (its tombstone once pruned), made empty if the ledger has none."""
        tomb = self.tombs.get(job_id)
        if tomb is not None and job_id not in self.jobs:
            return tomb
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
        to a tombstone: run id, last seq, owner and final state (what a restart needs), kept in
        :attr:`tombs` and appended to ``<state>.tombs`` by the next :meth:`save`."""
        for job_id, job in list(self.jobs.items()):
            if (job.get("done") and job["lastSeq"] <= self.cursor and "inst" in job and not job.get("want")
                    and not job.get("settle")):
                del self.jobs[job_id]
                self.tombs[job_id] = {
                    "flowRunId": job["flowRunId"],
                    "lastSeq": job["lastSeq"],
                    "done": True,
                    "owned": job.get("owned", True),
                    "final": job.get("final"),
                }
                self._unsaved_tombs.append(job_id)

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
