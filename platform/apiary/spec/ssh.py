"""OpenPAI's ``ssh`` runtime plugin as a job asks for it, and the rule for an SSH public key.

A job turns it on as OpenPAI documents (openpai-runtime ``src/plugins/ssh/README.md``)::

    extras:
      com.microsoft.pai.runtimeplugin:
        - plugin: ssh
          taskroles: [master, worker]      # optional: the task roles it applies to (default all)
          parameters:
            jobssh: true                   # the instances share a key pair and reach each other
            sshbarrier: true               # the commands wait until every peer's sshd answers
            sshbarrierTimeout: 30          # minutes (OpenPAI's unit and default), a positive number
            userssh: {type: custom, value: "ssh-ed25519 AAAA... me@laptop"}
          failurePolicy: fail              # or ignore: an sshd or barrier failure does not fail the task

Every instance of a task role it applies to runs an sshd on its named port ``ssh``. ``userssh``
adds public keys (OpenPAI's ``custom`` type: the value is one or more key lines) to those stored
on the user's account. ``jobssh: true`` gives the job's instances one key pair and an ssh_config
so that ``ssh <taskrole>-<index>`` reaches an instance; ``sshbarrier`` (which, as in OpenPAI's
``init.py``, needs ``jobssh``) makes the commands wait for every peer, failing the attempt with
exit code 249 (PAIRuntimeSSHBarrierTimeout) after ``sshbarrierTimeout`` minutes.

Apiary holds the parameters to OpenPAI's names and types: an unknown parameter or entry key, or a
value of the wrong type, is a :class:`ValidationError` naming the field. OpenPAI's ``init.py``
turns ``jobssh`` off when ``gangAllocation`` is false; Apiary refuses that job instead (the job
would run without what it asked for). Two ssh entries that apply to the same task role are
refused too. It is pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from apiary.errors import ValidationError

#: The key of OpenPAI's runtime plugin list in ``extras`` (as :mod:`apiary.spec.admission`'s).
_PLUGINS = "com.microsoft.pai.runtimeplugin"
#: OpenPAI's SSH runtime plugin.
SSH_PLUGIN = "ssh"
#: The named port every instance's sshd listens on (OpenPAI's ``PAI_CONTAINER_SSH_PORT``).
SSH_PORT_NAME = "ssh"
#: OpenPAI's ``sshbarrier.sh``: 1,800 tries 10 s apart, 30 minutes.
DEFAULT_BARRIER_TIMEOUT_MIN = 30.0
#: The longest barrier Apiary accepts: a week, in minutes (OpenPAI leaves it open).
MAX_BARRIER_TIMEOUT_MIN = 7 * 24 * 60.0
#: Keys of one runtime plugin entry (openpai-runtime ``init.d/initializer.py``).
ENTRY_KEYS = frozenset({"plugin", "parameters", "failurePolicy", "taskroles"})
#: The ssh plugin's parameters (openpai-runtime ``plugins/ssh/init.py``).
PARAMETERS = frozenset({"jobssh", "sshbarrier", "sshbarrierTimeout", "userssh"})
#: ``userssh``'s keys and the types Apiary implements (OpenPAI's ``system`` type reads a key file
#: of OpenPAI's own deployment, which Apiary does not have).
USERSSH_KEYS = frozenset({"type", "value"})
USERSSH_TYPES = frozenset({"custom"})
FAILURE_POLICIES = frozenset({"fail", "ignore"})

#: Public key algorithms an authorized_keys line may name (OpenSSH 9's ``ssh -Q key``, minus
#: certificates, DSA and the like that OpenSSH no longer accepts by default).
KEY_TYPES = frozenset({
    "ssh-ed25519", "ssh-rsa", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com",
})
#: Most bytes of one public key line (an RSA 16384-bit key is about 2,800) and keys per value.
MAX_KEY_BYTES = 8192
MAX_KEYS = 100
_COMMENT = re.compile(r"^[\x20-\x7e]{0,200}$")


@dataclass(frozen=True)
class SshPlugin:
    """The ssh plugin of one task role: ``jobssh``, ``sshbarrier``, ``barrier_timeout_s`` (seconds),
    ``user_keys`` (the ``userssh`` public key lines, checked), ``failure_policy`` (``fail`` or
    ``ignore``)."""

    jobssh: bool = False
    sshbarrier: bool = False
    barrier_timeout_s: float = DEFAULT_BARRIER_TIMEOUT_MIN * 60
    user_keys: tuple[str, ...] = ()
    failure_policy: str = "fail"

    def to_wire(self) -> dict[str, Any]:
        return {"jobssh": self.jobssh, "sshbarrier": self.sshbarrier, "barrierTimeoutS": self.barrier_timeout_s,
                "failurePolicy": self.failure_policy}


def check_public_key(line: Any, field: str) -> str:
    """``line`` as one normalised authorized_keys line ``<type> <base64> [comment]``, else
    ValidationError naming ``field``. No options (``command=...``), no control characters; the
    base64 blob must decode and name the same algorithm as ``<type>`` (RFC 4253 section 6.6)."""
    if not isinstance(line, str):
        raise ValidationError(field, "must be an SSH public key line: '<type> <base64> [comment]'")
    text = line.strip()
    if not text or len(text.encode()) > MAX_KEY_BYTES:
        raise ValidationError(field, f"must be an SSH public key line of 1-{MAX_KEY_BYTES} bytes")
    parts = text.split(None, 2)
    kind = parts[0]
    if kind not in KEY_TYPES:
        raise ValidationError(field, f"{kind[:40]!r} is not an SSH public key type (one of "
                                     f"{', '.join(sorted(KEY_TYPES))}); options such as command= are not accepted")
    if len(parts) < 2:
        raise ValidationError(field, "the key has no base64 part")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError(field, "the key's base64 part does not decode") from None
    size = int.from_bytes(blob[:4], "big") if len(blob) >= 4 else -1
    if size != len(kind) or blob[4:4 + size] != kind.encode():
        raise ValidationError(field, f"the key's base64 part is not a {kind} key")
    comment = parts[2] if len(parts) > 2 else ""
    if not _COMMENT.fullmatch(comment):
        raise ValidationError(field, "the key's comment must be printable ASCII of at most 200 characters")
    return " ".join(p for p in (kind, parts[1], comment) if p)


def check_public_keys(value: Any, field: str) -> tuple[str, ...]:
    """The key lines of ``value`` (one or more lines; blank lines and ``#`` comments skipped), each
    checked by :func:`check_public_key`; ValidationError naming ``field`` (``field[i]`` for a line)."""
    if not isinstance(value, str):
        raise ValidationError(field, "must be a string of SSH public key lines")
    lines = [line for line in value.replace("\\n", "\n").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    if len(lines) > MAX_KEYS:
        raise ValidationError(field, f"at most {MAX_KEYS} keys")
    return tuple(check_public_key(line, f"{field}[{i}]" if len(lines) > 1 else field) for i, line in enumerate(lines))


def _bool(params: dict[str, Any], name: str, base: str) -> bool:
    value = params.get(name, False)
    if not isinstance(value, bool):
        raise ValidationError(f"{base}.{name}", f"must be true or false, got {value!r}")
    return value


def _parse_entry(entry: dict[str, Any], base: str) -> SshPlugin:
    unknown = sorted(set(entry) - ENTRY_KEYS)
    if unknown:
        raise ValidationError(f"{base}.{unknown[0]}", f"unknown key of a runtime plugin; one of {sorted(ENTRY_KEYS)}")
    policy = entry.get("failurePolicy", "fail")
    if policy not in FAILURE_POLICIES:
        raise ValidationError(f"{base}.failurePolicy", f"must be one of {sorted(FAILURE_POLICIES)}, got {policy!r}")
    params = entry.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValidationError(f"{base}.parameters", "must be a mapping of the ssh plugin's parameters")
    pbase = f"{base}.parameters"
    unknown = sorted(set(params) - PARAMETERS)
    if unknown:
        raise ValidationError(f"{pbase}.{unknown[0]}",
                              f"unknown parameter of the ssh plugin; one of {sorted(PARAMETERS)}")
    timeout = params.get("sshbarrierTimeout", DEFAULT_BARRIER_TIMEOUT_MIN)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_BARRIER_TIMEOUT_MIN:
        raise ValidationError(f"{pbase}.sshbarrierTimeout",
                              f"must be a number of minutes in (0, {MAX_BARRIER_TIMEOUT_MIN:g}], got {timeout!r}")
    keys: tuple[str, ...] = ()
    if "userssh" in params:
        user = params["userssh"]
        if not isinstance(user, dict):
            raise ValidationError(f"{pbase}.userssh", "must be a mapping {type: custom, value: <public keys>}")
        unknown = sorted(set(user) - USERSSH_KEYS)
        if unknown:
            raise ValidationError(f"{pbase}.userssh.{unknown[0]}", "unknown key; userssh has type and value")
        if user.get("type") not in USERSSH_TYPES:
            raise ValidationError(f"{pbase}.userssh.type",
                                  f"must be one of {sorted(USERSSH_TYPES)}, got {user.get('type')!r}")
        keys = check_public_keys(user.get("value", ""), f"{pbase}.userssh.value")
    return SshPlugin(jobssh=_bool(params, "jobssh", pbase), sshbarrier=_bool(params, "sshbarrier", pbase),
                     barrier_timeout_s=float(timeout) * 60, user_keys=keys, failure_policy=policy)


def ssh_plugins(extras: dict[str, Any] | None, task_roles: Iterable[str], *, gang: bool = True) -> dict[str, SshPlugin]:
    """``{task role: SshPlugin}`` for the roles an ssh entry applies to (absent: no sshd there).
    ``extras``: the job's ``extras`` as plain data; ``gang``: the job's ``gangAllocation``.

    Raises ValidationError naming the field for a malformed entry (see the module doc), a
    ``taskroles`` naming a role the job lacks, two entries for one role, ``sshbarrier`` without
    ``jobssh``, and ``jobssh`` in a job that is not gang-allocated.
    """
    plugins = (extras or {}).get(_PLUGINS)
    if not isinstance(plugins, list):
        return {}  # admission refuses a plugin list that is not a list, naming its field
    roles = list(task_roles)
    out: dict[str, SshPlugin] = {}
    for i, entry in enumerate(plugins):
        if not isinstance(entry, dict) or entry.get("plugin") != SSH_PLUGIN:
            continue
        base = f"extras.{_PLUGINS}[{i}]"
        plugin = _parse_entry(entry, base)
        if plugin.sshbarrier and not plugin.jobssh:
            raise ValidationError(f"{base}.parameters.sshbarrier", "needs jobssh: true (the barrier reaches the "
                                  "peers with the job's key, as in OpenPAI)")
        if plugin.jobssh and not gang:
            raise ValidationError(f"{base}.parameters.jobssh", "needs gang allocation (extras.gangAllocation: "
                                  "true): the instances must start together")
        chosen = entry.get("taskroles", roles)
        if not isinstance(chosen, list) or not all(isinstance(r, str) for r in chosen):
            raise ValidationError(f"{base}.taskroles", "must be a list of task role names")
        for j, role in enumerate(chosen):
            if role not in roles:
                raise ValidationError(f"{base}.taskroles[{j}]",
                                      f"names task role {role!r}, which the job does not have")
            if role in out:
                raise ValidationError(f"{base}.taskroles" if "taskroles" in entry else f"{base}.plugin",
                                      f"a second ssh plugin entry for task role {role!r}")
            out[role] = plugin
    return out
