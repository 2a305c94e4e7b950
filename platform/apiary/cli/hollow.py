"""``apiary hollow-nodes``: many hollow node agents in one process (:mod:`apiary.runtime.hollow`),
Apiary's kubemark. Mounted by the main CLI as ``app.command("hollow-nodes")(hollow_nodes)``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import typer

from apiary import gcpolicy
from apiary.cli.common import err, settings, setup_logging


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/M"`` -> ``(K, M)`` with ``0 <= K < M``; raises typer.BadParameter naming ``--shard``."""
    k, sep, m = text.partition("/")
    try:
        shard = (int(k), int(m)) if sep else (-1, 0)
    except ValueError:
        shard = (-1, 0)
    if not 0 <= shard[0] < shard[1]:
        raise typer.BadParameter(f"{text!r} is not K/M with 0 <= K < M (e.g. 0/2)", param_hint="--shard")
    return shard


def pick_nodes(inventory: dict[str, int], names: list[str], count: int | None,
               shard: tuple[int, int]) -> dict[str, int]:
    """The nodes to run: ``names`` (each must be in ``inventory``, name -> GPUs), else the first ``count``
    of the inventory by name, else all of it; then every M-th from the K-th (``shard``). Raises
    typer.BadParameter for a name the cluster does not have."""
    unknown = [n for n in names if n not in inventory]
    if unknown:
        raise typer.BadParameter(f"not in the cluster config: {', '.join(unknown[:5])}", param_hint="--node")
    chosen = names or sorted(inventory)
    if not names and count is not None:
        chosen = chosen[:count]
    k, m = shard
    return {n: inventory[n] for n in chosen[k::m]}


def read_tokens(credentials: Path) -> dict[str, str]:
    """node -> agent token from ``credentials/agent-<node>.token`` (the files ``apiary up`` or the
    control plane's bootstrap writes, mode 0600)."""
    from apiary.auth.bootstrap import read_token

    return {p.name[len("agent-"):-len(".token")]: read_token(p) or "" for p in credentials.glob("agent-*.token")}


def fetch_inventory(api: str, token: str, ca_cert: Path | None, timeout_s: float = 60.0) -> dict[str, int]:
    """node -> GPUs from ``GET /api/v2/nodes`` (any agent's token reads it), retried until ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.get(f"{api}/api/v2/nodes", timeout=30, headers={"Authorization": f"Bearer {token}"},
                          verify=str(ca_cert) if ca_cert else True)
            r.raise_for_status()
            return {n["name"]: int(n["gpus"]) for n in r.json()}
        except httpx.HTTPError as e:
            if time.monotonic() > deadline:
                err.print(f"[red]error[/red]: {api} does not list its nodes: {e}")
                raise typer.Exit(1) from None
            time.sleep(0.5)


def hollow_nodes(
    api: list[str] = typer.Option(..., help="Control-plane URL (repeat for replicas: nodes are spread over them)."),
    node: list[str] = typer.Option([], help="Node(s) to run a hollow agent for (default: --count, else all)."),
    count: int | None = typer.Option(None, min=1, help="Run the first N nodes of the cluster (by name)."),
    shard: str | None = typer.Option(None, help="K/M: run every M-th of the chosen nodes from the K-th (0-based)."),
    credentials: Path | None = typer.Option(
        None, help="Directory of the nodes' agent-<node>.token files (default APIARY_HOME/credentials)."
    ),
    ca_cert: Path | None = typer.Option(None, help="Verify the control plane's HTTPS against this CA certificate."),
    heartbeat_s: float | None = typer.Option(None, help="Heartbeat period (s; default and minimum: the agent's)."),
    long_poll_s: float | None = typer.Option(None, min=1, max=60,
                                             help="Assignments long-poll wait (s; default the agent's)."),
    stats: Path | None = typer.Option(None, help="On exit, write what the hollow agents measured here (JSON)."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run hollow node agents (simulated GPUs, tasks that are timers: sleep N runs N seconds, then
    exits 0) in this process, each heartbeating and long-polling like a real agent. SIGTERM or
    SIGINT stops them (and writes --stats)."""
    from apiary.runtime.agent import HEARTBEAT_S, LONG_POLL_S
    from apiary.runtime.hollow import run_hollow_nodes

    setup_logging(verbose)
    # Thousands of agents are a large, long-lived heap: CPython's full collections of it paused this
    # process's event loop, every agent at once, for up to 0.97 s at 2,500 agents a process
    # (bench/cluster.py at 5,000 nodes, hollow_gc_pause_max_ms). The control plane's policy keeps
    # them short (apiary.gcpolicy).
    gcpolicy.install()
    creds = (credentials or settings().credentials_dir).expanduser()
    tokens = read_tokens(creds)
    if not tokens:
        err.print(f"[red]error[/red]: no agent-<node>.token files in {creds} (--credentials)")
        raise typer.Exit(1)
    urls = [u.rstrip("/") for u in api]
    inventory = fetch_inventory(urls[0], next(iter(tokens.values())), ca_cert)
    nodes = pick_nodes(inventory, node, count, parse_shard(shard) if shard else (0, 1))
    missing = [n for n in nodes if not tokens.get(n)]
    if missing:
        err.print(f"[red]error[/red]: no token for {len(missing)} node(s) in {creds}, e.g. {missing[0]}")
        raise typer.Exit(1)

    async def main() -> dict:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        report = await run_hollow_nodes(urls, nodes, tokens, stop=stop, ca_cert=ca_cert,
                                        heartbeat_s=heartbeat_s or HEARTBEAT_S, long_poll_s=long_poll_s or LONG_POLL_S)
        return report.to_dict()

    out = asyncio.run(main())
    if stats is not None:
        tmp = stats.with_suffix(stats.suffix + ".tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, stats)


if __name__ == "__main__":  # python -m apiary.cli.hollow (the cluster benchmark starts it so)
    typer.run(hollow_nodes)
