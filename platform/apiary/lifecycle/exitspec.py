"""OpenPAI's job exit spec: what an exit code means and how the platform reacts to it.

The spec is ``k8s-job-exit-spec.yaml`` in this package, a verbatim copy of OpenPAI's
``src/k8s-job-exit-spec/config/k8s-job-exit-spec.yaml`` (MIT). It is read with :mod:`importlib.resources`
and parsed once. Each entry gives a ``behavior`` (``TRANSIENT`` / ``TRANSIENT_CONFLICT`` / ``PERMANENT`` /
``UNKNOWN``) and a ``reaction`` (``ALWAYS_RETRY`` / ``ALWAYS_BACKOFF_RETRY`` / ``RETRY_TO_MAX`` /
``NEVER_RETRY``) that :mod:`apiary.lifecycle.policy` turns into retry decisions.

The ``EXIT_*`` constants are the codes Apiary itself issues for outcomes it causes or observes; each is
an entry of the spec (checked by the tests), chosen as documented beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType

import yaml

__all__ = [
    "EXIT_ATTEMPT_COMPLETED",
    "EXIT_LAUNCH_FAILED",
    "EXIT_LIVENESS_FAILED",
    "EXIT_NODE_LOST",
    "EXIT_PREEMPTED",
    "EXIT_SSH_BARRIER_TIMEOUT",
    "EXIT_STOPPED",
    "EXIT_SUCCEEDED",
    "UNDEFINED_NEGATIVE_EXIT",
    "UNDEFINED_POSITIVE_EXIT",
    "ExitInfo",
    "classify_exit",
    "exit_spec",
]

SPEC_RESOURCE = "k8s-job-exit-spec.yaml"

# --- Codes Apiary issues (all present in the spec) -----------------------------------------------

#: 0 "Succeeded": the process exited 0.
EXIT_SUCCEEDED = 0

#: -1003 "PodPreemptedForCriticalPod" (PLATFORM_FAILURE, TRANSIENT, ALWAYS_RETRY): "Pod is preempted by
#: the kubelet of its node for the admission of other more critical platform Pod". The spec has no
#: HiveD-specific entry; this is its only preemption entry, and its behavior/reaction are what a
#: scheduler preemption needs (transient, always retried, not the user's fault). The generic
#: alternative, -101 "PodExternalDeleted", would hide that the cause was a preemption.
EXIT_PREEMPTED = -1003

#: -1001 "PodNodeLost" (PLATFORM_FAILURE, TRANSIENT, ALWAYS_RETRY): "Pod lost due to node lost, maybe its
#: kubelet is down for a long time". Apiary issues it when a node agent stops heart-beating.
EXIT_NODE_LOST = -1001

#: -210 "StopFrameworkRequested" (type USER_STOP, causer USER_STOP, PERMANENT, NEVER_RETRY): "User has
#: requested to stop the job".
EXIT_STOPPED = -210

#: -220 "FrameworkAttemptCompletion" (type USER_STOP, PERMANENT, NEVER_RETRY): "Stop to complete current
#: job attempt". Issued for tasks still running when the completion policy ends the attempt (e.g. the
#: second instance of a role with minSucceededInstances 1).
EXIT_ATTEMPT_COMPLETED = -220

#: -1203 "ContainerDockerStartCmdNotFound" (stage LAUNCHING, PERMANENT, NEVER_RETRY): "Failed to start
#: docker container due to cmd not found". The spec's entries for "the process could not be started" are
#: the ContainerCannotRun family: -1202 (permission denied), -1203 (command not found) and -1204
#: (unknown start error, RETRY_TO_MAX). -1203 is the common case (the entrypoint cannot be executed)
#: and is permanent, so an attempt whose tasks all fail to launch fails instead of looping. The runtime
#: may issue -1202 / -1204 where it can tell them apart; :func:`classify_exit` knows all three.
EXIT_LAUNCH_FAILED = -1203

#: -1006 "PodNodeAdmissionUnexpectedError" (PLATFORM_FAILURE, TRANSIENT, ALWAYS_RETRY): "Pod is rejected by
#: the kubelet due to unexpected error". Apiary issues it when a node cannot mount a task's storage (the
#: storage server is down or refuses): on Kubernetes such a pod never starts and the kubelet reports the
#: volume's failure, the node's admission of the pod failing for a reason outside the job. It is the
#: platform's failure, so the attempt is retried and the retry does not count against jobRetryCount.
EXIT_MOUNT_FAILED = -1006

#: -300 "PodFailedWithoutFailedContainer" (UNKNOWN_FAILURE, behavior UNKNOWN, RETRY_TO_MAX): "Pod failed
#: but without any failed container, may be stopped by K8S". The spec has no liveness-probe entry. On
#: Kubernetes the kubelet kills a container whose liveness probe fails, so OpenPAI would report 143
#: (SIGTERM) or 137 (SIGKILL); both are TRANSIENT/ALWAYS_RETRY, which would retry a hung program forever
#: without counting jobRetryCount. -300 is the closest entry that says "the platform stopped it, cause
#: unknown" and has a bounded reaction (RETRY_TO_MAX counts against jobRetryCount).
EXIT_LIVENESS_FAILED = -300

#: 249 "PAIRuntimeSSHBarrierTimeout" (PLATFORM_FAILURE, PERMANENT, NEVER_RETRY): "SSH barrier reaches max
#: retry count". Issued by a task of a job with the ssh runtime plugin's ``sshbarrier`` when some peer's
#: sshd did not answer within ``sshbarrierTimeout`` minutes (:mod:`apiary.runtime.sshd`).
EXIT_SSH_BARRIER_TIMEOUT = 249

#: 256 "PAIRuntimeExitAbnormally": the spec's shadow fallback for every undefined positive exit code.
UNDEFINED_POSITIVE_EXIT = 256

#: -8000 "ContainerUndefinedNegativeExitCode": the spec's shadow fallback for every undefined negative code.
UNDEFINED_NEGATIVE_EXIT = -8000


@dataclass(frozen=True)
class ExitInfo:
    """One entry of the exit spec.

    ``code``: the exit code (for a fallback classification, the raw code, not 256 / -8000).
    ``phrase``: the spec's unique name (``ContainerSigKillReceived``). ``type``: ``USER_SUCCESS`` /
    ``USER_STOP`` / ``USER_FAILURE`` / ``PLATFORM_FAILURE`` / ``RESOURCE_ALLOCATION_TIMEOUT`` /
    ``UNKNOWN_FAILURE``. ``behavior``: ``TRANSIENT`` / ``TRANSIENT_CONFLICT`` / ``PERMANENT`` /
    ``UNKNOWN``. ``reaction``: ``ALWAYS_RETRY`` / ``ALWAYS_BACKOFF_RETRY`` / ``RETRY_TO_MAX`` /
    ``NEVER_RETRY``. ``reason``: why the code is issued ("" where the spec gives none, e.g. code 0).
    """

    code: int
    phrase: str
    type: str
    behavior: str
    reaction: str
    reason: str


def _load_spec_text() -> str:
    return resources.files(__package__).joinpath(SPEC_RESOURCE).read_text(encoding="utf-8")


@functools.cache
def exit_spec() -> Mapping[int, ExitInfo]:
    """Every entry of the spec, keyed by code (read-only, parsed once per process).

    Includes the two fallback entries 256 and -8000. An optional field the spec leaves out reads as the
    spec's "unknown" value: type ``UNKNOWN_FAILURE``, behavior ``UNKNOWN``, reaction ``RETRY_TO_MAX``,
    reason ``""`` (today only code 0 lacks a field: its reason).
    """
    # libyaml's loader when PyYAML has it (the pure-Python one took 0.15 s for this file, paid by
    # every process that classifies an exit code); same safe subset either way.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    document = yaml.load(_load_spec_text(), Loader=loader)  # noqa: S506 - a safe loader
    entries: dict[int, ExitInfo] = {}
    for raw in document["spec"]:
        info = ExitInfo(
            code=int(raw["code"]),
            phrase=str(raw["phrase"]),
            type=str(raw.get("type", "UNKNOWN_FAILURE")),
            behavior=str(raw.get("behavior", "UNKNOWN")),
            reaction=str(raw.get("reaction", "RETRY_TO_MAX")),
            reason=str(raw.get("reason", "")),
        )
        entries[info.code] = info
    return MappingProxyType(entries)


def classify_exit(code: int) -> ExitInfo:
    """The spec's meaning of exit ``code``.

    A code with its own entry returns that entry. Any other positive code returns the spec's "Undefined
    Positive ExitCodes" fallback (256 PAIRuntimeExitAbnormally, RETRY_TO_MAX) and any other negative code
    the "Undefined Negative ExitCodes" fallback (-8000 ContainerUndefinedNegativeExitCode, RETRY_TO_MAX),
    with ``.code`` set to the raw code: the spec says the raw code "should always override it to expose
    outside". Plain ``exit 1`` is not in the spec, so it classifies as the 256 fallback. Raises
    ``TypeError`` for a non-integer.
    """
    if isinstance(code, bool) or not isinstance(code, int):
        raise TypeError(f"exit code must be an int, got {code!r}")
    spec = exit_spec()
    if code in spec:
        return spec[code]
    fallback = spec[UNDEFINED_POSITIVE_EXIT if code > 0 else UNDEFINED_NEGATIVE_EXIT]
    return dataclasses.replace(fallback, code=code)
