"""``apiary hosts``: hosts as network namespaces on one bridge, for drills and trying a multi-host
deployment on one machine (see :mod:`apiary.hosts.netns`). Needs root.

- ``apiary hosts up NAME... --root DIR``: make the hosts; ``DIR/hosts.json`` records them (and
  keeps them across invocations: they stay until ``down``), ``DIR/<name>`` is each host's state
  directory. Prints each host's address and the operator's (this machine's) address on the bridge.
- ``apiary hosts list --root DIR``: the hosts recorded in ``DIR``.
- ``apiary hosts exec NAME --root DIR -- CMD...``: run a command inside a host (its stdio is this
  command's; exits with its status), e.g. ``apiary hosts exec cp1 --root /srv/h -- apiary
  control-plane --host cp1``.
- ``apiary hosts down --root DIR``: stop every process in the hosts and remove them.
- ``apiary hosts cleanup [--prefix apy3-] [--force]``: remove what harnesses whose owner is gone
  left (namespaces, bridges, veths, their processes); ``--force`` removes the one ``--prefix``
  names even if it is live.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from apiary.hosts.netns import Hosts

hosts_app = typer.Typer(no_args_is_help=True,
                        help="Hosts as network namespaces on one bridge, for drills and tests (root).")
console = Console()
err = Console(stderr=True)

_ROOT = typer.Option(..., "--root", file_okay=False, help="The harness's directory (state file and host dirs).")


def _fail(e: Exception) -> typer.Exit:
    err.print(f"[red]error[/red]: {e}")
    return typer.Exit(1)


def _table(hosts: Hosts) -> Table:
    from apiary.hosts.netns import OPERATOR

    table = Table("host", "address", "namespace", "state dir", title=f"Hosts {hosts.prefix}")
    for h in hosts.all():
        table.add_row(h.name, h.address, h.namespace, str(h.state_dir))
    table.add_row(f"({OPERATOR})", hosts.operator_address, "(this machine)", "-")
    return table


@hosts_app.command("up")
def up_cmd(names: list[str] = typer.Argument(..., help="Host names (DNS labels), e.g. db cp1 node1."),
           root: Path = _ROOT) -> None:
    """Make the hosts; they stay until apiary hosts down --root DIR."""
    from apiary.hosts.netns import Hosts, HostsError

    try:
        existing = Hosts.attach(root)
    except HostsError:
        existing = None
    if existing is not None:
        err.print(f"[red]error[/red]: {root} holds harness {existing.prefix} already; "
                  f"run `apiary hosts down --root {root}` first")
        raise typer.Exit(1)
    try:
        hosts = Hosts(names, root, detached=True).up()
    except HostsError as e:
        raise _fail(e) from e
    console.print(_table(hosts))


@hosts_app.command("list")
def list_cmd(root: Path = _ROOT) -> None:
    """The hosts recorded in DIR."""
    from apiary.hosts.netns import Hosts, HostsError

    try:
        console.print(_table(Hosts.attach(root)))
    except HostsError as e:
        raise _fail(e) from e


@hosts_app.command("exec")
def exec_cmd(name: str = typer.Argument(..., help="The host to run in."),
             command: list[str] = typer.Argument(..., help="The command, after --."),
             root: Path = _ROOT) -> None:
    """Run a command inside a host: apiary hosts exec NAME --root DIR -- CMD...."""
    from apiary.hosts.netns import Hosts, HostsError

    try:
        argv = Hosts.attach(root).argv(name, command)
    except HostsError as e:
        raise _fail(e) from e
    raise typer.Exit(subprocess.run(argv, check=False).returncode)


@hosts_app.command("down")
def down_cmd(root: Path = _ROOT) -> None:
    """Stop every process in the hosts and remove them (their state directories stay)."""
    from apiary.hosts.netns import Hosts, HostsError

    try:
        hosts = Hosts.attach(root)
        prefix = hosts.prefix
        hosts.down()
    except HostsError as e:
        raise _fail(e) from e
    console.print(f"removed harness {prefix}")


@hosts_app.command("cleanup")
def cleanup_cmd(prefix: str | None = typer.Option(None, "--prefix", help="Only this harness (apy<k>-)."),
                force: bool = typer.Option(False, "--force", help="Remove the --prefix harness even if it is live."),
                ) -> None:
    """Remove what harnesses whose owner is gone left behind."""
    from apiary.hosts.netns import HostsError, cleanup_stale

    try:
        removed = cleanup_stale(prefix, force=force)
    except HostsError as e:
        raise _fail(e) from e
    console.print(f"removed {', '.join(removed)}" if removed else "nothing stale")
