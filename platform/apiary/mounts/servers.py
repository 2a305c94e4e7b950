"""Storage servers as OpenPAI defines them, and the command that mounts each on a node.

A storage server (OpenPAI's ``storage server``: ``{"spn": name, "type": type, "data": {...}}``,
here :class:`ServerSpec`) says where team-wise storage lives; a storage config (the lead's
``apiary.storage``) says which servers a group's jobs mount and where. The ``data`` keys are
camelCase, as in OpenPAI's storage server JSON:

===========  =====================================================================================
type         data
===========  =====================================================================================
local        ``{"rootPath": "/abs/dir"}``: a directory on the node; nothing is mounted, the
             directory itself is the server's root.
nfs          ``{"address": host, "rootPath": "/export", "options": "vers=4.1,..."?}``:
             ``mount -t nfs [-o options] address:rootPath TARGET`` (mount.nfs(8), nfs(5)).
glusterfs    ``{"address": host, "volume": name, "backupAddresses": [host, ...]?}``:
             ``mount -t glusterfs [-o backup-volfile-servers=h1:h2] address:/volume TARGET``
             (GlusterFS docs, "Setting up GlusterFS Client": backup-volfile-servers).
sshfs        ``{"address": host, "port": 22?, "user": name, "rootPath": "/dir",
             "identity": "<private key, PEM>", "hostKey": "ssh-ed25519 AAAA..."?}``: sshfs(1)
             over SFTP with that key, in batch mode (never a prompt).
===========  =====================================================================================

``identity`` is a secret: :func:`redacted` replaces it for API answers and logs, and
:func:`scrub` removes it from any text (a command's stderr) before that text goes anywhere.

Unknown keys are refused (a typo such as ``rootpath`` would otherwise be ignored silently), as
dstack's models forbid unknown fields. Host names, paths and options go into a command line, so
each is checked to be one plain argument (no leading ``-``, no whitespace, no NUL) here, before
anything runs.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apiary import procutil
from apiary.errors import ValidationError

__all__ = [
    "REDACTED",
    "SECRET_KEYS",
    "SERVER_TYPES",
    "ServerSpec",
    "check_server",
    "mount_argv",
    "mount_log",
    "redacted",
    "scrub",
]

#: The server types this node can mount (OpenPAI also has samba, azurefile and azureblob; not here).
SERVER_TYPES = ("local", "nfs", "glusterfs", "sshfs")
#: What :func:`redacted` puts in place of a secret.
REDACTED = "<redacted>"
#: Per type, the ``data`` keys that hold secrets.
SECRET_KEYS: dict[str, tuple[str, ...]] = {"sshfs": ("identity",)}
#: sshfs: seconds between keep-alives, and how many may go unanswered before ssh gives up, so a
#: dead server turns into EIO for the task after about 15 s instead of a hang (ssh_config(5)).
SSH_ALIVE_INTERVAL_S = 5
SSH_ALIVE_COUNT_MAX = 3
#: sshfs: seconds ssh waits for the TCP connection (ssh_config(5) ConnectTimeout).
SSH_CONNECT_TIMEOUT_S = 10

# A server name is part of a mount point's directory name: one path component, no dots first.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
# A host: a DNS name or IPv4 address (RFC 1123 labels), or an IPv6 address in brackets.
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
# GlusterFS volume names: letters, digits, '-' and '_' (gluster's CLI refuses anything else).
_VOLUME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A POSIX user name (useradd's default NAME_REGEX, plus upper case and dots).
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
# mount -o options: comma-separated key[=value], no whitespace.
_OPTIONS = re.compile(r"[A-Za-z0-9_.:/=+-]+(,[A-Za-z0-9_.:/=+-]+)*")
# A known_hosts key: "<type> <base64>" (sshd(8) "SSH_KNOWN_HOSTS FILE FORMAT"), no comment.
_HOST_KEY = re.compile(r"(ssh-[a-z0-9-]+|ecdsa-sha2-nistp(256|384|521)|sk-[a-z0-9@.-]+) [A-Za-z0-9+/]+={0,3}")

# type -> {key: (required, the Python type its JSON value must have)}
_DATA_KEYS: dict[str, dict[str, tuple[bool, type | tuple[type, ...]]]] = {
    "local": {"rootPath": (True, str)},
    "nfs": {"address": (True, str), "rootPath": (True, str), "options": (False, str)},
    "glusterfs": {"address": (True, str), "volume": (True, str), "backupAddresses": (False, list)},
    "sshfs": {"address": (True, str), "port": (False, int), "user": (True, str), "rootPath": (True, str),
              "identity": (True, str), "hostKey": (False, str)},
}


@dataclass(frozen=True)
class ServerSpec:
    """One storage server (OpenPAI's storage server: ``spn`` is ``name``).

    ``data`` is the type's dict (table in the module doc); the spec is not hashable (``data`` is a
    dict): key it by :attr:`key`.
    """

    name: str  #: the server's name, unique in the cluster (a path component: ``[A-Za-z0-9][A-Za-z0-9_.-]*``)
    type: str  #: one of :data:`SERVER_TYPES`
    data: dict  #: the type's settings, camelCase keys as in OpenPAI's JSON (may hold secrets)

    @property
    def key(self) -> str:
        """``<name>-<12 hex digits>``: the name and a short SHA-256 of type and data, so a server
        redefined under the same name (another address, another key) gets a mount of its own."""
        blob = json.dumps({"type": self.type, "data": self.data}, sort_keys=True, separators=(",", ":"))
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _plain_argument(field: str, value: str) -> None:
    if not value or value.startswith("-") or "\0" in value or any(c.isspace() for c in value):
        raise ValidationError(field, f"{value!r} is not one plain argument (empty, a leading '-', whitespace or NUL)")


def _check_abs_path(field: str, value: str) -> None:
    _plain_argument(field, value)
    if not value.startswith("/"):
        raise ValidationError(field, f"{value!r} is not an absolute path")
    if ".." in value.split("/"):
        raise ValidationError(field, f"{value!r} holds '..'")


def _check_host(field: str, value: str) -> None:
    if not _HOST.fullmatch(value):
        raise ValidationError(field, f"{value!r} is not a host name, an IPv4 address or a bracketed IPv6 address")


def check_server(spec: ServerSpec) -> None:
    """Check ``spec`` before anything is mounted or stored. Raises
    :class:`~apiary.errors.ValidationError` naming the field (``name``, ``type``,
    ``data.address``, ``data.backupAddresses[1]``, ...) for an unknown type, a missing, unknown or
    ill-typed key, or a value that is not one plain command-line argument."""
    if not isinstance(spec.name, str) or not _NAME.fullmatch(spec.name):
        raise ValidationError("name", f"{spec.name!r} is not a server name ([A-Za-z0-9][A-Za-z0-9_.-]*, <= 63)")
    if spec.type not in _DATA_KEYS:
        raise ValidationError("type", f"{spec.type!r} is not one of {', '.join(SERVER_TYPES)}")
    if not isinstance(spec.data, dict):
        raise ValidationError("data", "must be an object")
    keys = _DATA_KEYS[spec.type]
    for key in spec.data:
        if key not in keys:
            raise ValidationError(f"data.{key}", f"unknown key for a {spec.type} server (known: {', '.join(keys)})")
    for key, (required, typ) in keys.items():
        if key not in spec.data:
            if required:
                raise ValidationError(f"data.{key}", f"required for a {spec.type} server")
            continue
        value = spec.data[key]
        # bool is an int in Python; a port of `true` is a mistake, not 1
        if not isinstance(value, typ) or isinstance(value, bool):
            raise ValidationError(f"data.{key}", f"must be a {getattr(typ, '__name__', typ)}, got {value!r}")
    d = spec.data
    if "rootPath" in d:
        _check_abs_path("data.rootPath", d["rootPath"])
    if "address" in d:
        _check_host("data.address", d["address"])
    if spec.type == "nfs" and "options" in d and not _OPTIONS.fullmatch(d["options"]):
        raise ValidationError("data.options", f"{d['options']!r} is not comma-separated mount options")
    if spec.type == "glusterfs":
        if not _VOLUME.fullmatch(d["volume"]):
            raise ValidationError("data.volume", f"{d['volume']!r} is not a GlusterFS volume name ([A-Za-z0-9_-])")
        for i, host in enumerate(d.get("backupAddresses", [])):
            if not isinstance(host, str):
                raise ValidationError(f"data.backupAddresses[{i}]", f"must be a str, got {host!r}")
            _check_host(f"data.backupAddresses[{i}]", host)
    if spec.type == "sshfs":
        if not _USER.fullmatch(d["user"]):
            raise ValidationError("data.user", f"{d['user']!r} is not a user name")
        if not 1 <= d.get("port", 22) <= 65535:
            raise ValidationError("data.port", f"{d['port']} is not a TCP port (1..65535)")
        if "PRIVATE KEY-----" not in d["identity"]:
            raise ValidationError("data.identity", "must be a private key in PEM (or OpenSSH) form")
        if "hostKey" in d and not _HOST_KEY.fullmatch(d["hostKey"].strip()):
            raise ValidationError("data.hostKey", "must be one known_hosts key, '<type> <base64>'")


def redacted(spec: ServerSpec) -> dict[str, Any]:
    """A copy of ``spec.data`` with every secret (:data:`SECRET_KEYS`: sshfs's ``identity``)
    replaced by :data:`REDACTED`: what API answers and logs show."""
    secret = SECRET_KEYS.get(spec.type, ())
    return {k: (REDACTED if k in secret else v) for k, v in spec.data.items()}


def scrub(text: str, spec: ServerSpec) -> str:
    """``text`` with every secret of ``spec`` (whole, and each of its lines of 16 or more
    characters: a PEM key echoed line by line) replaced by :data:`REDACTED`."""
    for key in SECRET_KEYS.get(spec.type, ()):
        value = spec.data.get(key)
        if not isinstance(value, str) or not value:
            continue
        text = text.replace(value, REDACTED)
        for line in value.splitlines():
            if len(line.strip()) >= 16:
                text = text.replace(line.strip(), REDACTED)
    return text


def _ssh_files(spec: ServerSpec, private: Path) -> tuple[Path, Path, Path]:
    """Write the key and the known-hosts file of an sshfs server under ``private/<key>/`` (0700;
    files 0600) and empty its ssh log, returning the three paths."""
    d = spec.data
    where = procutil.private_dir(private / spec.key)
    identity = where / "identity"
    known_hosts = where / "known_hosts"
    key_text = d["identity"] if d["identity"].endswith("\n") else d["identity"] + "\n"  # ssh wants the newline
    procutil.write_private(identity, key_text)
    # known_hosts names a non-default port as "[host]:port" (sshd(8), SSH_KNOWN_HOSTS FILE FORMAT).
    port = d.get("port", 22)
    host = d["address"].strip("[]")
    pattern = host if port == 22 else f"[{host}]:{port}"
    procutil.write_private(known_hosts, f"{pattern} {d['hostKey'].strip()}\n" if "hostKey" in d else "")
    log = where / "ssh.log"
    procutil.write_private(log, "")
    return identity, known_hosts, log


def mount_log(spec: ServerSpec, private_dir: Path) -> str:
    """What the mount's client logged apart from its stderr (secrets not yet scrubbed: pass it
    through :func:`scrub`): for sshfs, ssh's own log (``ssh -E``: sshfs in the background sends
    ssh's stderr, "Host key verification failed." included, nowhere); ``""`` for other types."""
    if spec.type != "sshfs":
        return ""
    try:
        return (Path(private_dir) / spec.key / "ssh.log").read_text(errors="replace")
    except OSError:
        return ""


def mount_argv(spec: ServerSpec, target: Path, private_dir: Path) -> list[str]:
    """The command (argv) that mounts ``spec`` on ``target`` (an existing empty directory).

    For sshfs it first writes the private key (``identity``, 0600) and a ``known_hosts`` of its own
    under ``private_dir/<spec.key>/`` (created 0700): with ``hostKey`` ssh checks the server
    against it (``StrictHostKeyChecking=yes``), without it the first key seen is kept for this
    mount (``accept-new``). ``BatchMode=yes`` (no prompt ever), ``ServerAliveInterval`` /
    ``ServerAliveCountMax`` (a dead server fails the task's I/O instead of hanging it),
    ``reconnect`` and ``allow_other`` (tasks run as other uids than the agent).

    Raises :class:`~apiary.errors.ValidationError` as :func:`check_server` does, and for a
    ``local`` server, which is never mounted. The caller runs the command (with a timeout).
    """
    check_server(spec)
    d = spec.data
    if spec.type == "local":
        raise ValidationError("type", "a local server is a directory on the node: nothing to mount")
    if spec.type == "nfs":
        options = ["-o", d["options"]] if d.get("options") else []
        return ["mount", "-t", "nfs", *options, f"{d['address']}:{d['rootPath']}", str(target)]
    if spec.type == "glusterfs":
        backups = d.get("backupAddresses") or []
        options = ["-o", "backup-volfile-servers=" + ":".join(backups)] if backups else []
        return ["mount", "-t", "glusterfs", *options, f"{d['address']}:/{d['volume']}", str(target)]
    # sshfs
    identity, known_hosts, log = _ssh_files(spec, Path(private_dir))
    if any(c in str(identity) for c in ", \t"):  # sshfs -o splits on commas, ssh_command on blanks
        raise ValidationError("private_dir", f"{private_dir} holds a comma or a blank: sshfs options cannot carry it")
    options = [
        f"IdentityFile={identity}",
        "IdentitiesOnly=yes",
        f"UserKnownHostsFile={known_hosts}",
        "GlobalKnownHostsFile=/dev/null",
        "StrictHostKeyChecking=" + ("yes" if "hostKey" in d else "accept-new"),
        "BatchMode=yes",
        "PasswordAuthentication=no",
        f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}",
        f"ServerAliveInterval={SSH_ALIVE_INTERVAL_S}",
        f"ServerAliveCountMax={SSH_ALIVE_COUNT_MAX}",
        "reconnect",
        "allow_other",
        f"ssh_command=ssh -E {log}",  # ssh's log to a file: the table quotes it when the mount fails
    ]
    return ["sshfs", f"{d['user']}@{d['address']}:{d['rootPath']}", str(target),
            "-p", str(d.get("port", 22)), "-o", ",".join(options)]
