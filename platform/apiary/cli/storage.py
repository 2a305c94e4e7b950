"""``apiary storage``: team-wise storage (OpenPAI's servers, configs and grants) and its files.

* ``apiary storage server list | set NAME --type T --data K=V ... [--data-file K=PATH] | delete NAME``
  (admins): ``--data-file`` reads a value from a file (an sshfs server's ``identity`` key).
* ``apiary storage config list | get NAME | set NAME --mount POINT=SERVER[:PATH[:ro]] ... [--default]
  | delete NAME``; ``apiary storage grant GROUP CONFIG [--revoke]`` (admins; anyone lists and gets
  the configs their groups grant).
* ``apiary storage ls | put | get | rm CONFIG:PATH``: a granted config's files, streamed with a
  progress bar; ``put`` and ``get`` take a directory with ``-r``.

``CONFIG:PATH`` is relative to the config's mount point (:mod:`apiary.storage.files`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from apiary.cli.common import api_client, err, fail
from apiary.errors import ApiaryError, ValidationError

console = Console()
storage_app = typer.Typer(no_args_is_help=True, help="Team-wise storage: servers, configs, grants and files.")
server_app = typer.Typer(no_args_is_help=True, help="Storage servers (admins).")
config_app = typer.Typer(no_args_is_help=True, help="Storage configs: what a job mounts where.")
storage_app.add_typer(server_app, name="server")
storage_app.add_typer(config_app, name="config")


def _call(fn: Any) -> Any:
    try:
        return fn()
    except ApiaryError as e:
        fail(e)


def _pairs(items: list[str], option: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(ValidationError(option, f"{item!r} is not KEY=VALUE"))
        out[key] = value
    return out


def _typed(value: str) -> Any:
    """A ``--data`` value: JSON when it parses (ports, lists), else the text as it is."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_mount(text: str) -> dict:
    """``POINT=SERVER[:PATH[:ro|rw]]`` -> a mount info ``{mountPoint, server, path, permission}``."""
    point, sep, rest = text.partition("=")
    parts = rest.split(":")
    if not sep or not point or not parts[0] or len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise ValidationError("--mount", f"{text!r} is not POINT=SERVER[:PATH[:ro|rw]], e.g. /mnt/data=gfs:datasets:ro")
    return {"mountPoint": point, "server": parts[0], "path": parts[1] if len(parts) > 1 else "",
            "permission": parts[2] if len(parts) > 2 else "rw"}


def split_address(text: str) -> tuple[str, str]:
    config, sep, path = text.partition(":")
    if not sep or not config:
        fail(ValidationError("address", f"{text!r} is not CONFIG:PATH (e.g. home:data/digits.npz)"))
    return config, path


def _bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=err, transient=True)


@server_app.command("list")
def server_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """Every storage server, its type and connection data (secrets redacted)."""
    servers = _call(lambda: api_client().storage_servers())
    if as_json:
        print(json.dumps(servers, indent=2))
        return
    table = Table("server", "type", "data")
    for s in servers:
        table.add_row(s["name"], s["type"], json.dumps(s["data"], sort_keys=True))
    console.print(table)


@server_app.command("set")
def server_set(name: str, type_: str = typer.Option(..., "--type", help="local, nfs, glusterfs or sshfs."),
               data: list[str] = typer.Option([], "--data", help="KEY=VALUE (JSON values are parsed)."),
               data_file: list[str] = typer.Option([], "--data-file", help="KEY=PATH: the value is the file's text.")
               ) -> None:
    """Create or replace a storage server (OpenPAI's: e.g. --type glusterfs --data address=gfs1 --data volume=vol0)."""
    values = {k: _typed(v) for k, v in _pairs(data, "--data").items()}
    for key, path in _pairs(data_file, "--data-file").items():
        try:
            values[key] = Path(path).read_text()
        except OSError as e:
            fail(ValidationError("--data-file", f"cannot read {path}: {e}"))
    server = _call(lambda: api_client().put_storage_server(name, type_, values))
    print(json.dumps(server, indent=2))


@server_app.command("delete")
def server_delete(name: str) -> None:
    """Delete a storage server no config uses."""
    _call(lambda: api_client().delete_storage_server(name))


@config_app.command("list")
def config_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """The storage configs you may use (admins: all)."""
    configs = _call(lambda: api_client().storage_configs())
    if as_json:
        print(json.dumps(configs, indent=2))
        return
    table = Table("config", "default", "mounts")
    for c in configs:
        table.add_row(c["name"], "yes" if c["default"] else "", ", ".join(
            f"{m['mountPoint']}={m['server']}:{m['path']}:{m['permission']}" for m in c["mountInfos"]))
    console.print(table)


@config_app.command("get")
def config_get(name: str) -> None:
    """One storage config, as JSON."""
    print(json.dumps(_call(lambda: api_client().storage_config(name)), indent=2))


@config_app.command("set")
def config_set(name: str,
               mount: list[str] = typer.Option(..., "--mount", help="POINT=SERVER[:PATH[:ro|rw]], repeated."),
               default: bool = typer.Option(False, "--default", help="Mount it into jobs that name no config."),
               ) -> None:
    """Create or replace a storage config."""
    try:
        infos = [parse_mount(m) for m in mount]
    except ValidationError as e:
        fail(e)
    print(json.dumps(_call(lambda: api_client().put_storage_config(name, infos, default)), indent=2))


@config_app.command("delete")
def config_delete(name: str) -> None:
    """Delete a storage config no group is granted."""
    _call(lambda: api_client().delete_storage_config(name))


@storage_app.command("grant")
def grant(group: str, config: str, revoke: bool = typer.Option(False, "--revoke", help="Take the grant back.")) -> None:
    """Let a group's members use a storage config (or, with --revoke, no longer)."""
    g = _call(lambda: api_client().set_storage_grant(group, config, not revoke))
    print(f"group {g['name']}: storage configs {', '.join(g.get('storageConfigs', [])) or '-'}")


@storage_app.command("ls")
def ls(address: str = typer.Argument(..., help="CONFIG:PATH"), as_json: bool = typer.Option(False, "--json")) -> None:
    """A directory's entries in a storage config."""
    config, path = split_address(address)
    entries = _call(lambda: api_client().storage_list(config, path))
    if as_json:
        print(json.dumps(entries, indent=2))
        return
    for e in entries:
        stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime(e["mtime"]))
        print(f"{e['type'][0]} {e['size']:>12} {stamp} {e['name']}{'/' if e['type'] == 'dir' else ''}")


def _local_files(source: Path) -> list[tuple[Path, str]]:
    """``(file, its path relative to source)`` of a directory tree, sorted."""
    return sorted((p, p.relative_to(source).as_posix()) for p in source.rglob("*") if p.is_file())


@storage_app.command("put")
def put(source: Path = typer.Argument(..., exists=True), address: str = typer.Argument(..., help="CONFIG:PATH"),
        recursive: bool = typer.Option(False, "-r", "--recursive", help="Upload a directory tree."),
        no_overwrite: bool = typer.Option(False, "--no-overwrite", help="Refuse to replace a file.")) -> None:
    """Upload a file (or with -r a directory) to CONFIG:PATH; a PATH ending in / takes the file's name."""
    config, path = split_address(address)
    client = api_client()
    if source.is_dir():
        if not recursive:
            fail(ValidationError("source", f"{source} is a directory: use -r"))
        todo = [(f, f"{path.rstrip('/')}/{rel}" if path.strip("/") else rel) for f, rel in _local_files(source)]
    else:
        todo = [(source, path + source.name if path == "" or path.endswith("/") else path)]
    with _bar() as bar:
        for f, target in todo:
            task = bar.add_task(target, total=f.stat().st_size)
            _call(lambda f=f, target=target, task=task: client.storage_upload(
                config, target, f, overwrite=not no_overwrite, progress=lambda n: bar.advance(task, n)))
    for _, target in todo:
        print(f"{config}:{target}")


@storage_app.command("get")
def get(address: str = typer.Argument(..., help="CONFIG:PATH"),
        dest: Path = typer.Argument(Path("."), help="Local file or directory (default: here)."),
        recursive: bool = typer.Option(False, "-r", "--recursive", help="Download a directory tree.")) -> None:
    """Download CONFIG:PATH (a file, or with -r a directory tree)."""
    config, path = split_address(address)
    client = api_client()
    entry = _call(lambda: client.storage_list(config, path))
    is_dir = not (len(entry) == 1 and entry[0]["type"] == "file" and path.rstrip("/").endswith(entry[0]["name"]))
    todo: list[tuple[str, Path]] = []
    if is_dir:
        if not recursive:
            fail(ValidationError("address", f"{address} is a directory: use -r"))
        stack = [(path.strip("/"), dest / (Path(path.strip("/")).name or config))]
        while stack:
            remote, local = stack.pop()
            for e in _call(lambda remote=remote: client.storage_list(config, remote)):
                child = f"{remote}/{e['name']}" if remote else e["name"]
                if e["type"] == "dir":
                    stack.append((child, local / e["name"]))
                elif e["type"] == "file":
                    todo.append((child, local / e["name"]))
    else:
        todo.append((path, dest / entry[0]["name"] if dest.is_dir() else dest))
    with _bar() as bar:
        for remote, local in todo:
            local.parent.mkdir(parents=True, exist_ok=True)
            task = bar.add_task(remote, total=None)
            _call(lambda remote=remote, local=local, task=task: client.storage_download(
                config, remote, local, progress=lambda n, total: bar.update(task, advance=n, total=total or None)))
    for _, local in todo:
        print(local)


@storage_app.command("rm")
def rm(address: str = typer.Argument(..., help="CONFIG:PATH"),
       recursive: bool = typer.Option(False, "-r", "--recursive", help="Remove a directory tree.")) -> None:
    """Remove a file (or with -r a directory tree) from a storage config."""
    config, path = split_address(address)
    _call(lambda: api_client().storage_remove(config, path, recursive))
