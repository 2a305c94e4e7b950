"""Rules a new job must meet besides the OpenPAI protocol: what a node agent can always run.

:func:`apiary.spec.job.parse_job` applies them to every submitted job, after the protocol's own
checks, and skips them for a job reloaded from the store (``stored=True``: a job accepted before a
rule existed stays readable). Each failure is an :class:`apiary.errors.ValidationError` naming the
field:

* :func:`refuse_bad_text`: no string of the job, key or value, holds a NUL character or a lone
  surrogate. A NUL cannot be passed in an argv, an environment variable or a file name (the node
  agent's launch fails on it), PostgreSQL's ``text`` refuses it, and a lone surrogate has no UTF-8
  form at all;
* :func:`check_runtime_plugins`: every runtime plugin the job names under
  ``extras["com.microsoft.pai.runtimeplugin"]`` is one Apiary implements
  (:data:`IMPLEMENTED_RUNTIME_PLUGINS`), instead of the job running without it;
* :func:`check_rendered_sizes`: a task role's commands after ``<% %>`` substitution, and each
  registry credential of a ``dockerimage`` prerequisite, are at most :data:`MAX_RENDERED_BYTES`,
  counted without rendering them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from apiary.errors import ValidationError
from apiary.spec.templating import rendered_size


class RenderableJob(Protocol):
    """What :func:`check_rendered_sizes` reads of a job: :class:`apiary.spec.job.JobSpec` has it
    (a protocol, so this module need not import the job model that imports it)."""

    @property
    def task_roles(self) -> Mapping[str, Any]: ...
    @property
    def parameters(self) -> Mapping[str, Any] | None: ...
    @property
    def secrets(self) -> Mapping[str, Any] | None: ...
    @property
    def prerequisites(self) -> Sequence[Any] | None: ...

    def rendered_commands_size(self, role: str) -> int: ...

__all__ = [
    "IMPLEMENTED_RUNTIME_PLUGINS",
    "MAX_RENDERED_BYTES",
    "RUNTIME_PLUGIN_KEY",
    "check_rendered_sizes",
    "check_runtime_plugins",
    "path_key",
    "refuse_bad_text",
]

#: Most UTF-8 bytes one task role's rendered commands may take (its active deployment's
#: ``preCommands`` and ``postCommands`` included, one newline per line), and one rendered registry
#: credential. 1 MiB, the API's default request body cap (``APIARY_MAX_BODY_BYTES``, apiary.api.guards):
#: templating may make a job as large as a body could carry it written out, not larger. Without it a
#: 30 KB body referencing a 10 KB parameter 1,000 times became a 10 MB launch record and script on
#: its node, and a 1 MiB body could ask for about 13.7 GB.
MAX_RENDERED_BYTES = 1_048_576

#: Where an OpenPAI job lists its runtime plugins (rest-server and runtime: a list of
#: ``{plugin: <name>, parameters: {...}}``, e.g. ``ssh``, ``teamwise_storage``, ``tensorboard``).
RUNTIME_PLUGIN_KEY = "com.microsoft.pai.runtimeplugin"
#: The runtime plugins Apiary implements: ``teamwise_storage`` (its storage configs are mounted
#: into every task: :mod:`apiary.spec.storage`) and ``ssh`` (an sshd in every task, the job's key
#: pair, the barrier: :mod:`apiary.spec.ssh`) and ``tensorboard`` (TensorBoard behind the API's proxy:
#: :mod:`apiary.spec.tensorboard`). Any other (``git``, ``cmd``) is refused: a job that names it
#: would silently run without what it asked for.
IMPLEMENTED_RUNTIME_PLUGINS: frozenset[str] = frozenset({"teamwise_storage", "ssh", "tensorboard"})

_NUL_REASON = ("contains a NUL character (\\x00), which no string of a job may hold "
               "(no command line, environment variable or file name can carry one)")


def path_key(key: str) -> str:
    """A mapping key as a step of a dotted field path: as it is, or its ``repr`` when it holds a
    character that is not printable (a newline, a NUL), so the path stays one readable line."""
    return key if key.isprintable() else repr(key)


def _path(parent: str, step: str | int) -> str:
    if isinstance(step, int):
        return f"{parent}[{step}]"
    return f"{parent}.{path_key(step)}" if parent else path_key(step)


def _check_string(text: str, field: str, what: str) -> None:
    if "\x00" in text:
        raise ValidationError(field, f"{what} {_NUL_REASON}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValidationError(
                field, f"{what} holds a lone surrogate {text[exc.start]!r}, which no UTF-8 text can"
            ) from None


def refuse_bad_text(data: Any) -> None:
    """Refuse a NUL character or a lone surrogate in any string of ``data`` (the parsed job).

    Walks every mapping key and string value iteratively (the data nests at most safeyaml's 64
    levels, but this must not depend on it). Raises :class:`ValidationError` whose ``field`` is
    the value's dotted path (``taskRoles.train.commands[0]``) or, for a bad key, its mapping's
    path (``secrets``; ``body`` at the top) with the key, escaped, in the message.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_string(value, path or "body", "the value")
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    _check_string(key, path or "body", f"the key {key!r}")
                    stack.append((_path(path, key), item))
                else:
                    stack.append((_path(path, str(key)), item))
        elif isinstance(value, list):
            stack.extend((_path(path, i), item) for i, item in enumerate(value))


def check_runtime_plugins(extras: dict[str, Any] | None) -> None:
    """Refuse runtime plugins Apiary does not implement.

    ``extras``: the job's ``extras`` as plain data (None when absent). The value under
    :data:`RUNTIME_PLUGIN_KEY` must be a list of mappings, each with a string ``plugin`` in
    :data:`IMPLEMENTED_RUNTIME_PLUGINS`; an empty list is fine. Raises :class:`ValidationError`
    with ``field`` ``extras.com.microsoft.pai.runtimeplugin[<i>].plugin`` (or the list's path when
    it is not a list) and the plugin's name in the message.
    """
    if not extras or RUNTIME_PLUGIN_KEY not in extras:
        return
    base = f"extras.{RUNTIME_PLUGIN_KEY}"
    plugins = extras[RUNTIME_PLUGIN_KEY]
    if not isinstance(plugins, list):
        raise ValidationError(base, f"must be a list of {{plugin: <name>, parameters: {{...}}}}, got "
                                    f"{type(plugins).__name__}")
    implemented = ", ".join(sorted(IMPLEMENTED_RUNTIME_PLUGINS)) or "none"
    for i, entry in enumerate(plugins):
        name = entry.get("plugin") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise ValidationError(f"{base}[{i}].plugin", "each runtime plugin needs a name: {plugin: <name>}")
        if name not in IMPLEMENTED_RUNTIME_PLUGINS:
            raise ValidationError(
                f"{base}[{i}].plugin",
                f"runtime plugin {name!r} is not implemented by Apiary (implemented: {implemented}); "
                "the job would run without it, so it is refused: remove it from the job",
            )


def check_rendered_sizes(spec: RenderableJob, limit: int = MAX_RENDERED_BYTES) -> None:
    """Refuse a task role whose rendered commands, or a registry credential whose rendered value,
    exceed ``limit`` UTF-8 bytes (default :data:`MAX_RENDERED_BYTES`).

    Counted with :meth:`JobSpec.rendered_commands_size` and
    :func:`apiary.spec.templating.rendered_size`, so nothing is rendered. Credentials are counted
    against ``$parameters`` and ``$secrets`` (what the schema has them reference). Raises
    :class:`ValidationError`: field ``taskRoles.<role>.commands`` (the message names the role and
    the size) or ``prerequisites[<i>].auth.<key>``.
    """
    for role in spec.task_roles:
        size = spec.rendered_commands_size(role)
        if size > limit:
            raise ValidationError(
                f"taskRoles.{role}.commands",
                f"task role {role!r}: its commands render to {size} bytes after <% %> substitution "
                f"(its deployment's preCommands and postCommands included), more than {limit} bytes, "
                "Apiary's limit (the API's default body cap: templates may not make a job larger "
                "than it could be written out)",
            )
    context = {"parameters": spec.parameters or {}, "secrets": spec.secrets or {}}
    for i, prerequisite in enumerate(spec.prerequisites or []):
        auth = getattr(prerequisite, "auth", None)
        for key, value in (auth.model_dump(exclude_none=True) if auth is not None else {}).items():
            field = f"prerequisites[{i}].auth.{key}"
            size = rendered_size(value, context, field)
            if size > limit:
                raise ValidationError(
                    field, f"renders to {size} bytes after <% %> substitution, more than {limit} bytes"
                )
