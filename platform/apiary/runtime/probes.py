"""Task probes, node side: running Kubernetes-style liveness and readiness checks of tasks.

Semantics follow Kubernetes' container probes
(https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#container-probes); the node
agent runs them, as the kubelet does.  How a job declares them (``extras.apiary.taskRoles.<role>``),
the models and their parsing are in :mod:`apiary.spec.probes` (pure, checked at submit time); this
module re-exports those names, so ``from apiary.runtime.probes import parse_probes`` keeps working.

The handlers: ``exec`` runs the argv directly (no shell) with the task's environment and working
directory, in a session of its own whose process group is killed on timeout; ``httpGet`` does a
GET without following redirects or using a proxy, HTTPS certificates unverified (as Kubernetes);
``tcpSocket`` connects.  A port label is resolved from the task's
``PAI_CONTAINER_HOST_<label>_PORT_LIST`` (the first port).

What the results do
-------------------

* **Liveness**: before its first probe a task counts as live. After ``failureThreshold``
  consecutive failures the agent kills the task, which ends with the platform exit code
  :data:`apiary.lifecycle.EXIT_LIVENESS_FAILED` (-300, RETRY_TO_MAX), so the lifecycle retries
  it per the job's retry policy. A failed run is not probed again.
* **Readiness**: only reported (ready true/false), never kills. A task with a readiness probe
  is not ready until ``successThreshold`` consecutive successes, and turns unready after
  ``failureThreshold`` consecutive failures. Without a readiness probe, readiness is ``None``
  (Kubernetes would call it ready).

API
---

:class:`Prober` keeps the probe schedule of every watched run: :meth:`Prober.watch` when a run
starts, :meth:`Prober.due` (cheap, never blocks) to find runs with a probe due,
:meth:`Prober.check` (blocking, call it in a worker thread) to run them, :meth:`Prober.forget`
once the run has exited. Thread-safe: ``check`` may run in worker threads while the event loop
calls the other methods. The clock and the three handlers are injectable (tests).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from apiary.spec.probes import (
    DEFAULT_HOST,
    EXTRAS_KEY,
    LIVENESS,
    READINESS,
    Action,
    ExecAction,
    HTTPGetAction,
    HTTPHeader,
    ProbeSpec,
    TCPSocketAction,
    parse_probes,
    probes_from_wire,
    probes_to_wire,
    validate_probes,
)

__all__ = [
    "DEFAULT_HOST",
    "EXTRAS_KEY",
    "LIVENESS",
    "READINESS",
    "Action",
    "ExecAction",
    "HTTPGetAction",
    "HTTPHeader",
    "ProbeHandler",
    "ProbeResult",
    "ProbeSpec",
    "ProbeState",
    "ProbeTrack",
    "Prober",
    "TCPSocketAction",
    "exec_probe",
    "http_probe",
    "monotonic_from_wall",
    "parse_probes",
    "probes_from_wire",
    "probes_to_wire",
    "tcp_probe",
    "validate_probes",
]

#: Most of an exec probe's output (or an HTTP error) kept in a message (Kubernetes keeps 10 KiB).
MAX_MESSAGE_CHARS = 1024
_USER_AGENT = "apiary-probe/1"

# --------------------------------------------------------------------------- handlers

#: A probe handler: ``(action, env, cwd, timeout_s) -> (success, message)``. It must return within
#: about ``timeout_s``; an exception it raises counts as a failure (its text is the message).
ProbeHandler = Callable[[Any, Mapping[str, str], str, float], tuple[bool, str]]


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_MESSAGE_CHARS else "..." + text[-MAX_MESSAGE_CHARS:]


def _resolve_port(port: int | str, env: Mapping[str, str]) -> int:
    if isinstance(port, int):
        return port
    raw = env.get(f"PAI_CONTAINER_HOST_{port}_PORT_LIST", "")
    first = raw.split(",")[0].strip()
    if not first.isdigit():
        raise LookupError(f"port label {port!r} has no port in this task (PAI_CONTAINER_HOST_{port}_PORT_LIST unset)")
    return int(first)


def exec_probe(action: ExecAction, env: Mapping[str, str], cwd: str, timeout: float) -> tuple[bool, str]:
    """Run ``action.command`` with ``env`` in ``cwd``; success is exit 0. The command runs in a
    session of its own whose process group is SIGKILLed on timeout. ``PATH`` falls back to the
    agent's when ``env`` has none."""
    env = dict(env)
    env.setdefault("PATH", os.environ.get("PATH", os.defpath))
    try:
        proc = subprocess.Popen(
            action.command, env=env, cwd=cwd or None, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
        )
    except OSError as exc:
        return False, f"cannot run {action.command[0]!r}: {exc.strerror or exc}"
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:  # a grandchild left its group and holds the pipe
            proc.kill()
            proc.wait()
        return False, f"timed out after {timeout:g}s (killed)"
    text = _clip(out.decode("utf-8", "replace"))
    if proc.returncode == 0:
        return True, text
    return False, f"exit code {proc.returncode}" + (f": {text}" if text else "")


def http_probe(action: HTTPGetAction, env: Mapping[str, str], cwd: str, timeout: float) -> tuple[bool, str]:
    """GET the action's URL without following redirects or using a proxy; success is
    ``200 <= status < 400``. Connecting and receiving the response head are each bounded by
    ``timeout``; the body is not read."""
    port = _resolve_port(action.port, env)
    host = f"[{action.host}]" if ":" in action.host else action.host
    url = f"{action.scheme.lower()}://{host}:{port}{action.path}"
    headers = {"User-Agent": _USER_AGENT, "Accept": "*/*"}
    for h in action.http_headers or []:
        headers[h.name] = h.value
    try:
        with (
            httpx.Client(timeout=timeout, verify=False, trust_env=False, follow_redirects=False) as client,
            client.stream("GET", url, headers=headers) as resp,
        ):
            status = resp.status_code
    except httpx.TimeoutException:
        return False, f"GET {url}: timed out after {timeout:g}s"
    except httpx.HTTPError as exc:
        return False, _clip(f"GET {url}: {type(exc).__name__}: {exc}")
    ok = 200 <= status < 400
    return ok, f"GET {url}: HTTP {status}"


def tcp_probe(action: TCPSocketAction, env: Mapping[str, str], cwd: str, timeout: float) -> tuple[bool, str]:
    """Success is an accepted TCP connection to ``host:port`` within ``timeout``; it is closed at once."""
    port = _resolve_port(action.port, env)
    try:
        with socket.create_connection((action.host, port), timeout=timeout):
            return True, f"connected to {action.host}:{port}"
    except TimeoutError:
        return False, f"connect to {action.host}:{port}: timed out after {timeout:g}s"
    except OSError as exc:
        return False, f"connect to {action.host}:{port}: {exc.strerror or exc}"


# --------------------------------------------------------------------------- the prober


@dataclass
class ProbeTrack:
    """One probe of one run: its schedule and its consecutive results."""

    spec: ProbeSpec
    next_due: float
    successes: int = 0  # consecutive
    failures: int = 0  # consecutive
    runs: int = 0
    last_run: float | None = None
    last_ok: bool | None = None
    last_message: str = ""


@dataclass
class ProbeState:
    """Everything the prober keeps about one run (read it via :meth:`Prober.state`; don't mutate).

    ``ready``: ``None`` without a readiness probe, else False until ``successThreshold``
    consecutive successes. ``live_failed``: the liveness probe reached ``failureThreshold``;
    sticky, and the run is not probed again.
    """

    run_id: str
    started_at: float
    env: dict[str, str]
    cwd: str
    liveness: ProbeTrack | None
    readiness: ProbeTrack | None
    ready: bool | None
    live_failed: bool = False
    live_message: str = ""
    #: Put before an exec probe's command: runs it as the task's own uid (the runtime's
    #: ``exec_prefix``), never as the agent's user when tasks run isolated.
    exec_prefix: tuple[str, ...] = ()
    in_flight: bool = False


@dataclass(frozen=True)
class ProbeResult:
    """What :meth:`Prober.check` found. ``live_failed``: kill the run and report
    ``EXIT_LIVENESS_FAILED``. ``ready``: see :class:`ProbeState`. ``message``: what the probes
    that ran said (or why the liveness probe failed); ``""`` when none ran."""

    live_failed: bool
    ready: bool | None
    message: str = ""


@dataclass
class _Outcome:
    kind: str
    track: ProbeTrack
    started: float
    ok: bool
    message: str = field(default="")


class Prober:
    """Schedules and runs the probes of the runs it watches (see the module doc).

    ``clock``: monotonic seconds (``time.monotonic``; inject a fake in tests). ``run_exec``,
    ``run_http``, ``run_tcp``: the handlers (:data:`ProbeHandler`); the defaults do the real work.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        run_exec: ProbeHandler = exec_probe,
        run_http: ProbeHandler = http_probe,
        run_tcp: ProbeHandler = tcp_probe,
    ) -> None:
        self._clock = clock
        self._handlers: dict[type, ProbeHandler] = {
            ExecAction: run_exec, HTTPGetAction: run_http, TCPSocketAction: run_tcp,
        }
        self._lock = threading.Lock()
        self._runs: dict[str, ProbeState] = {}

    def watch(
        self,
        run_id: str,
        liveness: ProbeSpec | None,
        readiness: ProbeSpec | None,
        *,
        started_at_monotonic: float,
        env: Mapping[str, str],
        cwd: str,
        exec_prefix: Sequence[str] = (),
    ) -> None:
        """Start probing ``run_id``, which started at ``started_at_monotonic`` (on this prober's
        clock; see :func:`monotonic_from_wall`). The first probe of each kind is due
        ``initialDelaySeconds`` after the start. ``exec_prefix`` is put before every exec probe's
        argv (``setpriv ...``: the probe runs as the task does). No-op when both probes are None; a
        second ``watch`` of a watched run is ignored (its counters are kept)."""
        if liveness is None and readiness is None:
            return
        with self._lock:
            if run_id in self._runs:
                return

            def track(spec: ProbeSpec | None) -> ProbeTrack | None:
                return None if spec is None else ProbeTrack(spec, started_at_monotonic + spec.initial_delay_seconds)

            self._runs[run_id] = ProbeState(
                run_id=run_id, started_at=started_at_monotonic, env=dict(env), cwd=cwd,
                liveness=track(liveness), readiness=track(readiness),
                ready=None if readiness is None else False, exec_prefix=tuple(exec_prefix),
            )

    def forget(self, run_id: str) -> None:
        """Stop probing ``run_id`` (it exited). Unknown ``run_id``: no-op. A ``check`` running
        for it meanwhile finishes and its result is dropped."""
        with self._lock:
            self._runs.pop(run_id, None)

    def watching(self) -> list[str]:
        with self._lock:
            return sorted(self._runs)

    def state(self, run_id: str) -> ProbeState | None:
        with self._lock:
            return self._runs.get(run_id)

    def ready(self, run_id: str) -> bool | None:
        """The run's current readiness (never blocks): None if unwatched or without a readiness probe."""
        with self._lock:
            st = self._runs.get(run_id)
            return None if st is None else st.ready

    def due(self) -> list[str]:
        """Run ids with a probe due now, sorted; never blocks on a probe. Excludes runs whose
        ``check`` is in progress and runs whose liveness already failed."""
        now = self._clock()
        with self._lock:
            return sorted(
                rid for rid, st in self._runs.items()
                if not st.in_flight and not st.live_failed and any(t.next_due <= now for t in _tracks(st))
            )

    def next_due(self) -> float | None:
        """The earliest time (on the clock) any watched probe is due, or None."""
        with self._lock:
            times = [t.next_due for st in self._runs.values() if not st.live_failed for t in _tracks(st)]
        return min(times, default=None)

    def check(self, run_id: str) -> ProbeResult:
        """Run the probes of ``run_id`` that are due (liveness first), update the counters and
        return the run's state. Blocks for at most about the sum of the due probes' timeouts;
        call it in a worker thread (``asyncio.to_thread``). Probes nothing and returns the
        current state if the run is not watched (``ready=None``), already failed liveness, has
        nothing due, or has a ``check`` in progress in another thread."""
        with self._lock:
            st = self._runs.get(run_id)
            if st is None:
                return ProbeResult(False, None, "not watched")
            if st.live_failed or st.in_flight:
                return ProbeResult(st.live_failed, st.ready, st.live_message)
            now = self._clock()
            todo = [(k, t) for k, t in (("liveness", st.liveness), ("readiness", st.readiness))
                    if t is not None and t.next_due <= now]
            if not todo:
                return ProbeResult(False, st.ready, "")
            st.in_flight = True
            env, cwd, prefix = st.env, st.cwd, st.exec_prefix
        outcomes: list[_Outcome] = []
        try:
            for kind, tr in todo:
                started = self._clock()
                ok, message = self._run_one(tr.spec, env, cwd, prefix)
                outcomes.append(_Outcome(kind, tr, started, ok, message))
                if kind == "liveness" and not ok and tr.failures + 1 >= tr.spec.failure_threshold:
                    break  # about to be killed: its readiness no longer matters
        finally:
            with self._lock:
                st.in_flight = False
                for o in outcomes:
                    self._apply(st, o)
                result = ProbeResult(st.live_failed, st.ready,
                                     st.live_message if st.live_failed else "; ".join(
                                         f"{o.kind} {'ok' if o.ok else 'failed'}: {o.message}".rstrip(": ")
                                         for o in outcomes))
                if self._runs.get(run_id) is not st:
                    result = ProbeResult(False, None, "forgotten while probing")
        return result

    # ------------------------------------------------------------------ internals

    def _run_one(self, spec: ProbeSpec, env: Mapping[str, str], cwd: str,
                 prefix: tuple[str, ...] = ()) -> tuple[bool, str]:
        action = spec.action
        if prefix and isinstance(action, ExecAction):
            action = ExecAction(command=[*prefix, *action.command])
        handler = self._handlers[type(action)]
        timeout = float(spec.timeout_seconds)
        started = self._clock()
        try:
            ok, message = handler(action, env, cwd, timeout)
        except Exception as exc:  # noqa: BLE001 - a broken probe is a failed probe, never an agent crash
            return False, _clip(f"{spec.describe()}: {type(exc).__name__}: {exc}")
        if ok and self._clock() - started > timeout + 0.5:
            return False, f"{spec.describe()}: took longer than timeoutSeconds={spec.timeout_seconds}"
        return bool(ok), _clip(f"{spec.describe()}: {message}" if message else spec.describe())

    def _apply(self, st: ProbeState, o: _Outcome) -> None:
        tr, spec = o.track, o.track.spec
        tr.runs += 1
        tr.last_run = o.started
        tr.last_ok = o.ok
        tr.last_message = o.message
        nxt = tr.next_due + spec.period_seconds  # drift-free; never a burst after a stall
        tr.next_due = nxt if nxt > o.started else o.started + spec.period_seconds
        if o.ok:
            tr.successes += 1
            tr.failures = 0
        else:
            tr.failures += 1
            tr.successes = 0
        if o.kind == "liveness":
            if tr.failures >= spec.failure_threshold:
                st.live_failed = True
                st.live_message = _clip(
                    f"liveness probe failed {tr.failures} consecutive times "
                    f"(failureThreshold {spec.failure_threshold}): {o.message}"
                )
        else:
            if tr.successes >= spec.success_threshold:
                st.ready = True
            elif tr.failures >= spec.failure_threshold:
                st.ready = False


def _tracks(st: ProbeState) -> list[ProbeTrack]:
    return [t for t in (st.liveness, st.readiness) if t is not None]


def monotonic_from_wall(
    started_at_wall: float | None,
    *,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> float:
    """A run's start (unix seconds, e.g. :attr:`TaskStatus.started_at`) on the monotonic
    ``clock``: ``clock() - (wall() - started_at_wall)``. ``None`` (unknown) means now. Use it for
    :meth:`Prober.watch` so a run re-adopted after an agent restart keeps its schedule."""
    now = clock()
    if started_at_wall is None:
        return now
    return now - max(0.0, wall() - started_at_wall)
