"""Task probe declarations: Kubernetes-style liveness and readiness probes of an OpenPAI job.

Pure (models, parsing and validation only; no I/O), so :mod:`apiary.spec.job` checks them at
submit time.  Running them is the node side's job: :mod:`apiary.runtime.probes` (``Prober`` and
the exec/httpGet/tcpSocket handlers), which re-exports everything here.  Semantics follow
Kubernetes' container probes
(https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#container-probes).

Declaring probes
----------------

Per task role, under ``extras.apiary.taskRoles.<role>`` of an OpenPAI job (``extras`` is the
protocol's free-form plugin data)::

    extras:
      apiary:
        taskRoles:
          train:
            livenessProbe:
              exec: {command: [cat, /tmp/healthy]}
              initialDelaySeconds: 5
              periodSeconds: 5
            readinessProbe:
              tcpSocket: {port: 8080}

Every instance of the role gets the role's probes. A probe has exactly one handler:

* ``exec: {command: [argv...]}`` -- runs ``argv`` directly (no shell: write
  ``[sh, -c, "..."]`` for one) on the task's node with the task's environment and working
  directory; success is exit code 0. On timeout the probe's whole process group is killed.
* ``httpGet: {path: /, port, host: 127.0.0.1, scheme: HTTP, httpHeaders: [{name, value}]}`` --
  an HTTP GET; success is ``200 <= status < 400``. Redirects are not followed (a 3xx is a
  success, as Kubernetes counts it). ``scheme`` is ``HTTP`` or ``HTTPS`` (either case); HTTPS
  certificates are not verified (Kubernetes does not verify them either). No proxy is used.
* ``tcpSocket: {port, host: 127.0.0.1}`` -- success is an accepted TCP connection.

``port`` is a TCP port number, or the name of one of the task role's
``resourcePerInstance.ports`` labels: the instance's port of that label
(``PAI_CONTAINER_HOST_<label>_PORT_LIST``, the first one) is probed. ``host`` defaults to
``127.0.0.1`` (Kubernetes' default is the pod IP; a process task shares the node's network).

Timing fields (Kubernetes' names, defaults and minimums): ``initialDelaySeconds`` (0, >= 0)
after the task started before the first probe, ``periodSeconds`` (10, >= 1) between probes,
``timeoutSeconds`` (1, >= 1) per probe (a probe that takes longer fails),
``successThreshold`` (1, >= 1; must be 1 for liveness) consecutive successes to become ready
again, ``failureThreshold`` (3, >= 1) consecutive failures to count as failed. Integers only.
Unknown fields are rejected, as are ``startupProbe`` and ``grpc`` probes (not supported).

API
---

:func:`parse_probes` (one role) and :func:`validate_probes` (every role, for submit time) read
the declarations; both raise :class:`apiary.errors.ValidationError` naming the dotted field,
e.g. ``extras.apiary.taskRoles.train.livenessProbe.periodSeconds``.  :func:`probes_to_wire` and
:func:`probes_from_wire` carry a role's parsed probes to the node agent inside an assignment.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from apiary.errors import ValidationError

__all__ = [
    "DEFAULT_HOST",
    "EXTRAS_KEY",
    "LIVENESS",
    "READINESS",
    "Action",
    "ExecAction",
    "HTTPGetAction",
    "HTTPHeader",
    "ProbeSpec",
    "TCPSocketAction",
    "parse_probes",
    "probes_from_wire",
    "probes_to_wire",
    "validate_probes",
]

#: Where probes are declared: ``extras.<EXTRAS_KEY>.taskRoles.<role>.<livenessProbe|readinessProbe>``.
EXTRAS_KEY = "apiary"
LIVENESS = "livenessProbe"
READINESS = "readinessProbe"
DEFAULT_HOST = "127.0.0.1"
#: Port labels are C identifiers (apiary.spec.job); matched with ``fullmatch`` (``$`` would allow a trailing newline).
_LABEL_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

class _Model(BaseModel):
    # strict, like apiary.spec.job: YAML yields native ints; "5" is no integer and True no 1.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _check_port(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        if 0 < value < 65536:
            return value
        raise PydanticCustomError("probe_port", "port must be 1-65535, got {value}", {"value": value})
    if isinstance(value, str) and _LABEL_RE.fullmatch(value):
        return value  # a port label of resourcePerInstance.ports, resolved from the task's env
    raise PydanticCustomError(
        "probe_port",
        "port must be a TCP port number (1-65535) or a port label of resourcePerInstance.ports, got {value}",
        {"value": repr(value)},
    )


class ExecAction(_Model):
    """``exec``: ``command`` is the argv to run (non-empty list of strings; no shell)."""

    command: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


class HTTPHeader(_Model):
    name: Annotated[str, Field(min_length=1)]
    value: str


class HTTPGetAction(_Model):
    """``httpGet``: GET ``scheme://host:port/path``; success is ``200 <= status < 400``."""

    path: str = "/"
    port: int | str
    host: Annotated[str, Field(min_length=1)] = DEFAULT_HOST
    scheme: Literal["HTTP", "HTTPS"] = "HTTP"
    http_headers: list[HTTPHeader] | None = Field(None, alias="httpHeaders")

    @field_validator("port", mode="plain")
    @classmethod
    def _port(cls, value: Any) -> int | str:
        return _check_port(value)

    @field_validator("scheme", mode="before")
    @classmethod
    def _upper_scheme(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("path")
    @classmethod
    def _leading_slash(cls, value: str) -> str:
        return value if value.startswith("/") else f"/{value}"


class TCPSocketAction(_Model):
    """``tcpSocket``: success is an accepted connection to ``host:port``."""

    port: int | str
    host: Annotated[str, Field(min_length=1)] = DEFAULT_HOST

    @field_validator("port", mode="plain")
    @classmethod
    def _port(cls, value: Any) -> int | str:
        return _check_port(value)


Action = ExecAction | HTTPGetAction | TCPSocketAction


class ProbeSpec(_Model):
    """One probe (Kubernetes ``Probe``): exactly one handler plus the timing fields.

    Build it from wire data with ``ProbeSpec.model_validate({...})`` (camelCase names).
    """

    exec_: ExecAction | None = Field(None, alias="exec")
    http_get: HTTPGetAction | None = Field(None, alias="httpGet")
    tcp_socket: TCPSocketAction | None = Field(None, alias="tcpSocket")
    initial_delay_seconds: Annotated[int, Field(ge=0)] = Field(0, alias="initialDelaySeconds")
    period_seconds: Annotated[int, Field(ge=1)] = Field(10, alias="periodSeconds")
    timeout_seconds: Annotated[int, Field(ge=1)] = Field(1, alias="timeoutSeconds")
    success_threshold: Annotated[int, Field(ge=1)] = Field(1, alias="successThreshold")
    failure_threshold: Annotated[int, Field(ge=1)] = Field(3, alias="failureThreshold")

    @model_validator(mode="after")
    def _one_handler(self) -> ProbeSpec:
        handlers = [h for h in (self.exec_, self.http_get, self.tcp_socket) if h is not None]
        if len(handlers) != 1:
            raise PydanticCustomError(
                "probe_handler",
                "exactly one of exec, httpGet, tcpSocket must be given ({count} given)",
                {"count": len(handlers)},
            )
        return self

    @property
    def action(self) -> Action:
        """The probe's one handler.  ValidationError only for a spec built without validation
        (``model_construct``) and no handler."""
        for handler in (self.exec_, self.http_get, self.tcp_socket):
            if handler is not None:
                return handler
        raise ValidationError("probe", "exactly one of exec, httpGet, tcpSocket must be given (0 given)")

    def describe(self) -> str:
        """Short human-readable form of the handler, for messages."""
        a = self.action
        if isinstance(a, ExecAction):
            return f"exec {a.command!r}"
        if isinstance(a, HTTPGetAction):
            return f"httpGet {a.scheme.lower()}://{a.host}:{a.port}{a.path}"
        return f"tcpSocket {a.host}:{a.port}"


def _error_path(base: str, loc: tuple[int | str, ...]) -> str:
    out = base
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else f".{item}"
    return out


_PROBE_FIELDS = ("exec, httpGet, tcpSocket, initialDelaySeconds, periodSeconds, timeoutSeconds, successThreshold, "
                 "failureThreshold")


def _parse_one(raw: Any, base: str) -> ProbeSpec | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValidationError(base, f"must be a mapping, got {type(raw).__name__}")
    if "grpc" in raw:
        raise ValidationError(f"{base}.grpc", "grpc probes are not supported; use exec, httpGet or tcpSocket")
    try:
        return ProbeSpec.model_validate(dict(raw))
    except pydantic.ValidationError as exc:
        found = []
        for e in exc.errors(include_url=False):
            loc = tuple(e["loc"])
            reason = e["msg"]
            if e["type"] == "missing":
                reason = "required field is missing"
            elif e["type"] == "extra_forbidden":
                reason = f"unknown field (a probe takes {_PROBE_FIELDS})" if len(loc) == 1 else "unknown field"
            found.append((_error_path(base, loc), reason))
        path, reason = found[0]
        rest = "; ".join(f"{p}: {r}" for p, r in found[1:])
        raise ValidationError(path, f"{reason}; {rest}" if rest else reason) from None


def _role_block(extras: Any, task_role: str | None) -> tuple[Mapping[str, Any] | None, str]:
    """``extras.apiary.taskRoles`` (task_role None) or ``...taskRoles.<task_role>``, type-checked."""
    if isinstance(extras, BaseModel):
        extras = extras.model_dump(by_alias=True)
    if extras is None:
        return None, ""
    if not isinstance(extras, Mapping):
        raise ValidationError("extras", f"must be a mapping, got {type(extras).__name__}")
    path = f"extras.{EXTRAS_KEY}"
    node: Any = extras.get(EXTRAS_KEY)
    steps = ["taskRoles"] if task_role is None else ["taskRoles", task_role]
    for step in [None, *steps]:
        if step is not None:
            node = node.get(step)
            path = f"{path}.{step}"
        if node is None:
            return None, path
        if not isinstance(node, Mapping):
            raise ValidationError(path, f"must be a mapping, got {type(node).__name__}")
    return node, path


def parse_probes(
    extras: Mapping[str, Any] | BaseModel | None, task_role: str
) -> tuple[ProbeSpec | None, ProbeSpec | None]:
    """``(liveness, readiness)`` declared for ``task_role`` under ``extras.apiary.taskRoles``.

    ``extras`` is the job's ``extras`` as a mapping (wire names), or the :class:`JobSpec`'s
    ``extras`` model. Missing blocks mean no probe. Raises :class:`ValidationError` whose field is
    the dotted path of the first bad field (``extras.apiary.taskRoles.train.livenessProbe.periodSeconds``).
    """
    role, path = _role_block(extras, task_role)
    if role is None:
        return None, None
    if "startupProbe" in role:
        raise ValidationError(f"{path}.startupProbe", "startup probes are not supported; use livenessProbe "
                              "with initialDelaySeconds")
    liveness = _parse_one(role.get(LIVENESS), f"{path}.{LIVENESS}")
    readiness = _parse_one(role.get(READINESS), f"{path}.{READINESS}")
    if liveness is not None and liveness.success_threshold != 1:
        raise ValidationError(f"{path}.{LIVENESS}.successThreshold",
                              f"must be 1 for a liveness probe (as in Kubernetes), got {liveness.success_threshold}")
    return liveness, readiness


def validate_probes(
    extras: Mapping[str, Any] | BaseModel | None, task_roles: Iterable[str]
) -> dict[str, tuple[ProbeSpec | None, ProbeSpec | None]]:
    """Submit-time check of every role's probes: ``{role: (liveness, readiness)}`` for the roles
    that declare any. Also rejects ``extras.apiary.taskRoles`` keys that are not task roles of
    the job. Raises :class:`ValidationError` naming the field."""
    roles = list(task_roles)
    block, path = _role_block(extras, None)
    if block is None:
        return {}
    for name in block:
        if name not in roles:
            raise ValidationError(f"{path}.{name}", f"names no task role of the job (task roles: {', '.join(roles)})")
    out = {}
    for name in roles:
        probes = parse_probes(extras, name)
        if probes != (None, None):
            out[name] = probes
    return out


def probes_to_wire(liveness: ProbeSpec | None, readiness: ProbeSpec | None) -> dict[str, Any]:
    """JSON-able ``{"livenessProbe": {...}, "readinessProbe": {...}}`` (absent probes left out), for
    shipping a role's parsed probes to the node agent inside an assignment."""
    out: dict[str, Any] = {}
    for key, probe in ((LIVENESS, liveness), (READINESS, readiness)):
        if probe is not None:
            out[key] = probe.model_dump(mode="json", by_alias=True, exclude_none=True)
    return out


def probes_from_wire(data: Mapping[str, Any] | None) -> tuple[ProbeSpec | None, ProbeSpec | None]:
    """Inverse of :func:`probes_to_wire` (``None`` or ``{}``: no probes). Raises
    :class:`ValidationError` (field ``probes.livenessProbe...``) for malformed data."""
    if not data:
        return None, None
    if not isinstance(data, Mapping):
        raise ValidationError("probes", f"must be a mapping, got {type(data).__name__}")
    return _parse_one(data.get(LIVENESS), f"probes.{LIVENESS}"), _parse_one(data.get(READINESS), f"probes.{READINESS}")

