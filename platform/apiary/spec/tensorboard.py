"""OpenPAI's ``tensorboard`` runtime plugin as a job asks for it, and the commands that run it.

A job turns it on as OpenPAI documents it (openpai-runtime ``src/plugins/tensorboard/README.md``)::

    extras:
      com.microsoft.pai.runtimeplugin:
        - plugin: tensorboard
          parameters:
            logdir: {train: /mnt/home/runs/train, eval: /mnt/home/runs/eval}   # name: path, at least one
            port: 6006                  # accepted for OpenPAI's jobs; Apiary uses the named port instead
          failurePolicy: fail           # or ignore: the task runs on without TensorBoard

As in OpenPAI's ``init.py``, TensorBoard runs in the background of one instance only, index 0 of
the first task role the entry applies to (``taskroles``, default every role: the job's first), over
the log directories (one: ``--logdir``; several: ``--logdir_spec name:path,...``). Apiary serves it on
that role's named port :data:`PORT_NAME` (``tensorboard``, chosen from the run id like every named
port, so two jobs on a node never collide on OpenPAI's fixed ``port``), with its path prefix set to
the instance's proxy path, so the API's proxy (``apiary job open ID --tensorboard``) reaches it.
TensorBoard has no login of its own: the commands wrap its WSGI app in a gate that answers only
requests carrying the instance's proxy secret (``Authorization: token $APIARY_PROXY_TOKEN``, which
the proxy adds), so other users on the node's shared network cannot read it. It runs with the
task's ``python3`` (the process runtime's tasks: the agent's virtual environment), which must have
``tensorboard`` installed (OpenPAI pip-installs it when missing; Apiary's tasks have no network
to install from): without it the task fails (``failurePolicy: fail``) or runs on without it.

Unknown keys, a parameter of the wrong type, an empty ``logdir`` and a second ``tensorboard`` entry
are a :class:`ValidationError` naming the field. It is pure: no I/O.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from apiary.errors import ValidationError

_PLUGINS = "com.microsoft.pai.runtimeplugin"
PLUGIN = "tensorboard"
#: The named port TensorBoard listens on.
PORT_NAME = "tensorboard"
ENTRY_KEYS = frozenset({"plugin", "parameters", "failurePolicy", "taskroles"})
PARAMETERS = frozenset({"logdir", "port"})
FAILURE_POLICIES = frozenset({"fail", "ignore"})
#: A ``logdir`` name: it is joined into ``--logdir_spec name:path,...``.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

#: The gate around TensorBoard's WSGI app (``program.TensorBoard(server_class=...)``, TensorBoard's
#: documented hook): 403 unless the request carries the instance's proxy secret.
GATE = '''import hmac, os, sys
from tensorboard import program
secret = ("token " + os.environ.get("APIARY_PROXY_TOKEN", "")).encode()
def gate(app):
    def gated(environ, start_response):
        if len(secret) > 6 and hmac.compare_digest(environ.get("HTTP_AUTHORIZATION", "").encode(), secret):
            return app(environ, start_response)
        start_response("403 Forbidden", [("Content-Type", "text/plain")])
        return [b"TensorBoard answers only through the Apiary proxy\\n"]
    return gated
tb = program.TensorBoard(server_class=lambda app, flags: program.WerkzeugServer(gate(app), flags))
tb.configure(argv=["tensorboard", *sys.argv[1:]])
sys.exit(tb.main())
'''


@dataclass(frozen=True)
class TensorBoardPlugin:
    """The plugin of one job: the task ``role`` whose instance 0 runs TensorBoard, its ``logdirs``
    (name, path) in the job's order, and whether a TensorBoard that cannot start fails the task."""

    role: str
    logdirs: tuple[tuple[str, str], ...]
    fail: bool = True

    def commands(self, role: str, index: int) -> list[str]:
        """The shell lines instance ``role``/``index`` runs before its own commands: TensorBoard in
        the background on instance 0 of :attr:`role`, nothing elsewhere."""
        if role != self.role or index != 0:
            return []
        if len(self.logdirs) == 1:
            where = f"--logdir {shlex.quote(self.logdirs[0][1])}"
        else:
            where = "--logdir_spec " + shlex.quote(",".join(f"{n}:{p}" for n, p in self.logdirs))
        prefix = ('"/api/v2/jobs/$APIARY_JOB_ID/proxy/$PAI_CURRENT_TASK_ROLE_NAME/'
                  f'$PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX/{PORT_NAME}"')
        missing = ("exit 1" if self.fail else "true")
        return [
            "# the tensorboard runtime plugin: TensorBoard behind the proxy secret, in the background",
            "if python3 -c 'import tensorboard' 2>/dev/null; then",
            f"  python3 -c {shlex.quote(GATE)} {where} --port \"$PAI_CONTAINER_HOST_{PORT_NAME}_PORT_LIST\" "
            f"--host 0.0.0.0 --path_prefix {prefix} >&2 &",
            "else",
            "  echo 'tensorboard runtime plugin: python3 has no tensorboard package' >&2",
            f"  {missing}",
            "fi",
        ]


def tensorboard_plugin(extras: dict[str, Any] | None, task_roles: Sequence[str]) -> TensorBoardPlugin | None:
    """The job's tensorboard plugin (None: it names none). ``extras``: the job's ``extras`` as plain
    data; ``task_roles``: its role names in the job's order. Raises :class:`ValidationError` naming
    the field for an unknown key or parameter, a bad ``logdir`` (empty, not a mapping of names to
    paths), ``port`` not an integer in 1..65535, ``taskroles`` naming a role the job lacks, and a
    second tensorboard entry."""
    plugins = (extras or {}).get(_PLUGINS)
    if not isinstance(plugins, list):
        return None
    found: TensorBoardPlugin | None = None
    for i, entry in enumerate(plugins):
        if not isinstance(entry, dict) or entry.get("plugin") != PLUGIN:
            continue
        base = f"extras.{_PLUGINS}[{i}]"
        if found is not None:
            raise ValidationError(f"{base}.plugin", "a second tensorboard entry: a job runs one TensorBoard")
        unknown = sorted(set(entry) - ENTRY_KEYS)
        if unknown:
            raise ValidationError(f"{base}.{unknown[0]}",
                                  f"unknown key of a runtime plugin; one of {sorted(ENTRY_KEYS)}")
        policy = entry.get("failurePolicy", "fail")
        if policy not in FAILURE_POLICIES:
            raise ValidationError(f"{base}.failurePolicy", f"must be one of {sorted(FAILURE_POLICIES)}, got {policy!r}")
        chosen = entry.get("taskroles", list(task_roles))
        if not isinstance(chosen, list) or not chosen or not all(isinstance(r, str) for r in chosen):
            raise ValidationError(f"{base}.taskroles", "must be a non-empty list of task role names")
        for j, role in enumerate(chosen):
            if role not in task_roles:
                raise ValidationError(f"{base}.taskroles[{j}]",
                                      f"names task role {role!r}, which the job does not have")
        params = entry.get("parameters")
        if not isinstance(params, dict):
            raise ValidationError(f"{base}.parameters", "must be a mapping with logdir: {name: path}")
        unknown = sorted(set(params) - PARAMETERS)
        if unknown:
            raise ValidationError(f"{base}.parameters.{unknown[0]}", f"unknown parameter; one of {sorted(PARAMETERS)}")
        port = params.get("port")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
            raise ValidationError(f"{base}.parameters.port", f"must be an integer port 1..65535, got {port!r}")
        found = TensorBoardPlugin(next(r for r in task_roles if r in chosen),
                                  _logdirs(params.get("logdir"), f"{base}.parameters.logdir"), policy == "fail")
    return found


def _logdirs(value: Any, field: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not value:
        raise ValidationError(field, "must be a non-empty mapping of names to log directories (OpenPAI's logdir)")
    out = []
    for name, path in value.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValidationError(field, f"name {name!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if not isinstance(path, str) or not path or "," in path:
            raise ValidationError(f"{field}.{name}", "must be a directory path without a comma")
        out.append((name, path))
    return tuple(out)
