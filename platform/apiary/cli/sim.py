"""``apiary sim``: the trace-driven scheduler simulator (same scheduler, simulated clock and nodes).

* ``apiary sim trace --trace FILE (--cluster HIVED.yaml | --machines MACHINES.csv) [--policy P]...
  [--json OUT] [--plots DIR] [--limit N]``: replay a Philly or generic CSV trace under ``hived``,
  ``quota`` and ``fifo`` (all three by default) and write the metrics (see :mod:`apiary.sim.replay`).
* ``apiary sim scenario SCENARIO.yaml [--json]``: replay a timed event list against a HiveD config
  (see :mod:`apiary.sim.scenario`).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from apiary.errors import ApiaryError

sim_app = typer.Typer(no_args_is_help=True, help="Trace-driven scheduler simulator (what-if replay, scenarios).")
err = Console(stderr=True)


def summary_table(doc: dict) -> Table:
    table = Table("policy", "jobs", "rejected", "wall s", "delay mean s", "delay p95 s", "JCT mean s", "GPU util",
                  "preemptions", "sharing anomaly s", title="What-if replay")
    for name, m in doc["policies"].items():
        table.add_row(
            name, str(m["jobs"]), str(m["rejected"]), f"{m['wall_s']:.2f}", str(m["queue_delay_s"]["mean"]),
            str(m["queue_delay_s"]["p95"]), str(m["jct_s"]["mean"]), f"{m['gpu_utilization']:.4f}",
            str(m["preemptions"]), str(m["sharing_anomaly_s"]),
        )
    return table


@sim_app.command("trace")
def trace_cmd(
    trace: Path = typer.Option(..., "--trace", exists=True, dir_okay=False, help="Philly or generic CSV trace."),
    cluster: Path | None = typer.Option(None, "--cluster", exists=True, dir_okay=False, help="HiveD cluster config."),
    machines: Path | None = typer.Option(None, "--machines", exists=True, dir_okay=False,
                                         help="Machine list CSV (machineId, number of GPUs)."),
    policy: list[str] = typer.Option(None, "--policy", help="hived, quota or fifo; repeat for several (default all)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the metrics JSON here ('-' = stdout)."),
    plots: Path | None = typer.Option(None, "--plots", file_okay=False, help="Write PNG plots into this folder."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Replay only the first N jobs of the file."),
) -> None:
    """Replay a job trace on a cluster under several scheduling policies."""
    from apiary.sim.replay import POLICIES, replay

    if (cluster is None) == (machines is None):
        err.print("Give exactly one of --cluster and --machines.")
        raise typer.Exit(2)
    try:
        doc, _ = replay(trace, cluster=cluster, machines=machines, policies=policy or list(POLICIES), limit=limit,
                        plots=plots)
    except ApiaryError as e:
        err.print(f"error: {e.message}")
        raise typer.Exit(1) from None
    text = json.dumps(doc, indent=2)
    if json_out is None or str(json_out) == "-":
        if json_out is None:
            Console().print(summary_table(doc))
        else:
            print(text)
    else:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text + "\n", encoding="utf-8")
        Console().print(summary_table(doc))
        Console().print(f"metrics written to {json_out}")


@sim_app.command("scenario")
def scenario_cmd(
    scenario: Path = typer.Argument(..., exists=True, dir_okay=False, help="Scenario YAML (cluster + events)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (default: a table)."),
) -> None:
    """Replay a timed event list (submit, fail-node, recover-node) against a HiveD cluster config."""
    from apiary.sim.scenario import run_scenario

    try:
        doc = run_scenario(scenario)
    except ApiaryError as e:
        err.print(f"error: {e.message}")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    table = Table("job", "state", "submitted", "started", "finished", "retries", "preemptions", "placements",
                  title=str(scenario))
    for job_id, j in doc["jobs"].items():
        last = j["attempts"][-1]["placements"] if j["attempts"] else []
        table.add_row(job_id, j["state"], str(j["submitted"]), str(j["started"]), str(j["finished"]),
                      str(j["retries"]), str(j["preemptions"]),
                      ", ".join(f"{p['taskRole']}[{p['index']}]@{p['node']}:{p['leafCellIndices']}" for p in last))
    Console().print(table)
