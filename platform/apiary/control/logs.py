"""Task logs: the bytes node agents send, kept as one file per run and stream, and read back.

A run's stream is ``<logs_dir>/<run id>.<stream>.log``; agents send ``[offset, offset+len)`` slices,
overlaps are skipped, so a resend after a failure is harmless (idempotent). Only the agent of the
node a run is placed on may write its log.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from sqlalchemy import select

from apiary.control.cache import PlaneCache
from apiary.errors import ForbiddenError, NotFoundError, UnavailableError, ValidationError
from apiary.store.models import Job, Task
from apiary.store.unit import reading

logger = logging.getLogger(__name__)


def check_chunks(chunks: Sequence[tuple[str, str, int, bytes]]) -> None:
    """Raise ValidationError (``logs.stream``, ``logs.offset``) for a ``(run id, stream, offset,
    bytes)`` chunk whose stream is not stdout or stderr or whose offset is negative."""
    for _run, stream, offset, _data in chunks:
        if stream not in ("stdout", "stderr"):
            raise ValidationError("logs.stream", "must be stdout or stderr")
        if offset < 0:
            raise ValidationError("logs.offset", "must be >= 0")


class LogService:
    """Log files under ``logs_dir`` (created) for the runs of the plane's ``cache``'s store."""

    def __init__(self, cache: PlaneCache, logs_dir: Path) -> None:
        self.cache = cache
        self.logs_dir = Path(logs_dir)
        self.logs_dir.mkdir(parents=True, exist_ok=True)

    def log_file(self, run_id: str, stream: str) -> Path:
        """Where ``stream`` (``stdout`` / ``stderr``) of run ``run_id`` is kept."""
        return self.logs_dir / f"{run_id}.{stream}.log"

    def append_log(self, run_id: str, stream: str, offset: int, data: bytes, *, node: str | None = None) -> int:
        """Store bytes ``[offset, offset+len(data))`` of a run's stream; overlaps are skipped, so
        agents may resend after a failure (idempotent). Returns the stored size. ``node``: the
        sending agent's node; a run not placed there is refused (ForbiddenError). Raises
        ValidationError (bad stream or offset), UnavailableError when the disk refuses the write
        (the agent resends)."""
        if stream not in ("stdout", "stderr"):
            raise ValidationError("stream", "must be stdout or stderr")
        if offset < 0:
            raise ValidationError("offset", "must be >= 0")
        if node is not None:
            with reading(self.cache.sessions, "read logs") as s:
                placed = s.scalar(select(Task.node).where(Task.run_id == run_id))
            if placed != node:
                logger.warning("refused log node=%s run=%s: the run is placed on %s", node, run_id, placed)
                raise ForbiddenError(f"Run {run_id} is not placed on node {node}.")
        return self._write_log(run_id, stream, offset, data)

    def append_logs(self, node: str, chunks: Sequence[tuple[str, str, int, bytes]]) -> list[int | None]:
        """:meth:`append_log` for each ``(run id, stream, offset, bytes)`` a node report carries,
        with one query for where the runs are placed. A chunk of a run not placed on ``node`` is
        left out (None, logged) rather than refusing the report: the heartbeat and statuses with
        it still count. Returns each chunk's stored size, in order. Raises ValidationError (bad
        stream or offset) and UnavailableError (disk) as append_log does, before or while writing;
        chunks are idempotent, so the agent resends the report."""
        check_chunks(chunks)
        if not chunks:
            return []
        with reading(self.cache.sessions, "read logs") as s:
            q = select(Task.run_id, Task.node).where(Task.run_id.in_({run for run, *_ in chunks}))
            placed: dict[str, str | None] = {run: where for run, where in s.execute(q)}
        return self.store_placed(node, chunks, placed)

    def store_placed(self, node: str, chunks: Sequence[tuple[str, str, int, bytes]],
                     placed: Mapping[str, str | None]) -> list[int | None]:
        """The writes of :meth:`append_logs` once the caller has read where the chunks' runs are
        placed (``placed``: run id -> node; a run missing from it is not placed anywhere): a node
        report's transaction reads that with the runs' owners. The chunks were checked by the
        caller (:func:`check_chunks`). Returns each chunk's stored size, or None for a chunk of a
        run not placed on ``node`` (left out, logged). Raises UnavailableError when the disk
        refuses a write."""
        sizes: list[int | None] = []
        for run_id, stream, offset, data in chunks:
            if placed.get(run_id) != node:
                logger.warning("refused log node=%s run=%s: the run is placed on %s", node, run_id, placed.get(run_id))
                sizes.append(None)
                continue
            sizes.append(self._write_log(run_id, stream, offset, data))
        return sizes

    def _write_log(self, run_id: str, stream: str, offset: int, data: bytes) -> int:
        path = self.log_file(run_id, stream)
        size = path.stat().st_size if path.exists() else 0
        if offset + len(data) > size:
            try:
                with path.open("ab") as f:
                    f.write(data[max(size - offset, 0):])
            except OSError as e:
                raise UnavailableError(f"cannot store the log of {run_id}: {e.strerror or e}; retry later.") from e
            size = offset + len(data) if offset <= size else size + len(data)
        return size

    def read_logs_many(self, reads: Iterable[tuple[str, str | None, int, int | None, str, int]]) -> list[str | None]:
        """:meth:`read_logs` for each ``(job id, task role, index, attempt, stream, offset)``, in
        order; None for a read whose job or task role does not exist or whose stream is not
        stdout, stderr or all (the others still answer). One store session and two queries for
        the whole batch (the jobs, then their tasks' run ids), not a session per read."""
        reads = list(reads)
        if not reads:
            return []
        with reading(self.cache.sessions, "read logs") as s:
            jobs = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_({r[0] for r in reads})))}
            specs = {job_id: self.cache.spec_of(job) for job_id, job in jobs.items()}
            runs: dict[tuple[str, str, int], list[tuple[int, str]]] = {}
            if jobs:
                q = (select(Task.job_id, Task.task_role, Task.index, Task.attempt, Task.run_id)
                     .where(Task.job_id.in_(jobs)).order_by(Task.attempt, Task.task_attempt))
                for job_id, role, index, attempt, run_id in s.execute(q):
                    if run_id:
                        runs.setdefault((job_id, role, index), []).append((attempt, run_id))
        out: list[str | None] = []
        for job_id, role, index, attempt, stream, offset in reads:
            spec = specs.get(job_id)
            if spec is None or stream not in ("stdout", "stderr", "all"):
                out.append(None)
                continue
            role = role or next(iter(spec.task_roles))
            if role not in spec.task_roles:
                out.append(None)
                continue
            mine = [run for at, run in runs.get((job_id, role, index), ()) if attempt is None or at == attempt]
            out.append(self._read_runs(mine, stream, offset))
        return out

    def read_logs(
        self, job_id: str, *, task_role: str | None = None, index: int = 0, attempt: int | None = None,
        stream: str = "stdout", offset: int = 0,
    ) -> str:
        """A task instance's log text (all its runs in the attempt, oldest first), from ``offset`` bytes."""
        if stream not in ("stdout", "stderr", "all"):
            raise ValidationError("stream", "must be stdout, stderr or all")
        with reading(self.cache.sessions, "read logs") as s:
            job = s.get(Job, job_id)
            if job is None:
                raise NotFoundError(f"Job {job_id} not found.")
            spec = self.cache.spec_of(job)
            role = task_role or next(iter(spec.task_roles))
            if role not in spec.task_roles:
                raise ValidationError("taskRole", f"job {job_id} has no task role {role!r}")
            q = select(Task).where(Task.job_id == job.id, Task.task_role == role, Task.index == index)
            if attempt is not None:
                q = q.where(Task.attempt == attempt)
            runs = [t.run_id for t in s.scalars(q.order_by(Task.attempt, Task.task_attempt)) if t.run_id]
        return self._read_runs(runs, stream, offset)

    def _read_runs(self, runs: Sequence[str], stream: str, offset: int) -> str:
        """The runs' ``stream`` (stdout | stderr | all) files concatenated in order, from byte
        ``offset``, decoded as UTF-8 (bad bytes replaced)."""
        streams = ("stdout", "stderr") if stream == "all" else (stream,)
        data = b""
        for run in runs:
            for st in streams:
                p = self.log_file(run, st)
                if p.exists():
                    data += p.read_bytes()
        return data[offset:].decode("utf-8", errors="replace")
