"""``apiary incident`` and ``apiary oncall``: incident response from the command line.

* ``apiary incident list [--state S] [--json]``, ``apiary incident show ID [--json]``
* ``apiary incident open TITLE [--severity sev3] [--node N] [--job J] [--description D]``
* ``apiary incident ack|mitigate|resolve|close|reopen ID [--message M] [--verdict actionable|noise]``
* ``apiary incident comment ID MESSAGE``
* ``apiary incident action ID ACTION --node N`` (cordon-node, drain-node, uncordon-node, ...)
* ``apiary incident postmortem ID [--edit FILE]``, ``apiary incident items [--status open]``
* ``apiary incident quality [--days 7]``: the alert-quality report (Markdown)
* ``apiary oncall [--at ISO]``: who is on call now, per schedule and per escalation tier

Each calls the REST API with the CLI's token; the actor recorded is that token's user.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from apiary.cli.common import api_client, fail
from apiary.cli.tables import COMPACT, folded, uncut, when, word
from apiary.errors import ApiaryError

incident_app = typer.Typer(no_args_is_help=True, help="Incidents: open, acknowledge, mitigate, resolve, postmortems.")
console = Console()


def _call(method: str, path: str, **kw) -> Any:
    try:
        r = api_client()._call(method, path, **kw)
    except ApiaryError as e:
        fail(e)
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


def _print_incident(i: dict) -> None:
    console.print(Text(f"Incident {i['id']} [{i['severity']}] {i['state']}: {i['title']}", style="bold"))
    links = i.get("links") or {}
    for key in ("nodes", "jobs", "users", "virtualClusters"):
        if links.get(key):
            console.print(f"  {key}: {', '.join(links[key])}", markup=False, highlight=False)
    deadlines = i.get("deadlines") or {}
    console.print("  SLA deadlines: " + ", ".join(f"{k} {v or '-'}" for k, v in deadlines.items()),
                  markup=False, highlight=False)
    if i.get("breaches"):
        console.print(f"  SLA breached: {', '.join(i['breaches'])}", style="red", markup=False)
    table = Table(word("at (UTC)"), folded("actor"), word("event"), folded("detail"), title="Timeline", **COMPACT)
    for e in i.get("timeline") or []:
        detail = e.get("detail") or {}
        text = detail.get("message") or detail.get("text") or detail.get("reason") or ""
        if e["event"] == "notify":
            text = f"{detail.get('channel', '')} -> {detail.get('recipient', '')}: {detail.get('outcome', '')}"
        elif e["event"] == "action":
            text = f"{detail.get('action')} {detail.get('target') or ''}: {detail.get('result')}"
        elif e["event"] == "escalate":
            text = f"tier {detail.get('tier')} -> {', '.join(detail.get('targets') or [])}"
        table.add_row(when(e["at"]), Text(e["actor"]), e["event"], Text(str(text)))
    console.print(table)


@incident_app.command("list")
def list_command(state: str | None = typer.Option(None, "--state", help="triggered, acknowledged, mitigated, ..."),
                 limit: int = typer.Option(50, "--limit", min=1, max=1000),
                 as_json: bool = typer.Option(False, "--json", help="Print the API's JSON.")) -> None:
    """Incidents, newest first."""
    params: dict = {"limit": limit, **({"state": state} if state else {})}
    rows = _call("GET", "/api/v2/incidents", params=params)["incidents"]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(uncut("id", [r["id"] for r in rows], console), word("severity"), word("state"),
                  folded("opened (UTC)", min_width=10), folded("title"), title="Incidents (newest first)", **COMPACT)
    for r in rows:
        table.add_row(r["id"], r["severity"], r["state"], when(r["openedAt"]), Text(r["title"]))
    console.print(table)


@incident_app.command("show")
def show_command(incident_id: str, as_json: bool = typer.Option(False, "--json")) -> None:
    """One incident: links, SLA deadlines and its whole timeline."""
    data = _call("GET", f"/api/v2/incidents/{incident_id}")
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        _print_incident(data)


@incident_app.command("open")
def open_command(title: str, severity: str = typer.Option("sev3", "--severity", help="sev1 (worst) .. sev4."),
                 node: list[str] = typer.Option([], "--node", help="An affected node (repeatable)."),
                 job: list[str] = typer.Option([], "--job", help="An affected job id (repeatable)."),
                 description: str = typer.Option("", "--description")) -> None:
    """Open an incident by hand; the on-call is paged as for an alert."""
    data = _call("POST", "/api/v2/incidents", json={"title": title, "severity": severity, "nodes": node,
                                                    "jobs": job, "description": description})
    print(data["id"])


def _act(event: str):
    def command(incident_id: str, message: str | None = typer.Option(None, "--message", "-m"),
                verdict: str | None = typer.Option(None, "--verdict",
                                                   help="At resolve: was the alert actionable, or noise?")) -> None:
        body = {k: v for k, v in (("message", message), ("verdict", verdict)) if v}
        data = _call("POST", f"/api/v2/incidents/{incident_id}/{event}", json=body)
        print(f"incident {data['id']} {data['state']}")

    command.__doc__ = {"acknowledge": "Acknowledge: you own it; escalation stops.",
                      "mitigate": "The impact is contained (the cause may remain).",
                      "resolve": "Resolved; a Sev1/Sev2 gets a postmortem draft.",
                      "close": "Close after the review (final).",
                      "reopen": "Reopen a resolved incident; escalation restarts."}[event]
    return command


for _name, _event in (("ack", "acknowledge"), ("acknowledge", "acknowledge"), ("mitigate", "mitigate"),
                      ("resolve", "resolve"), ("close", "close"), ("reopen", "reopen")):
    incident_app.command(_name)(_act(_event))


@incident_app.command("comment")
def comment_command(incident_id: str, message: str) -> None:
    """Add a comment to the timeline."""
    _call("POST", f"/api/v2/incidents/{incident_id}/comment", json={"message": message})
    print("ok")


@incident_app.command("action")
def action_command(incident_id: str, action: str, node: str = typer.Option(..., "--node")) -> None:
    """Run a mitigation or its undo (cordon-node, uncordon-node, drain-node, tag-jobs:T, untag-jobs:T,
    notify-owners); recorded in the timeline."""
    data = _call("POST", f"/api/v2/incidents/{incident_id}/actions", json={"action": action, "node": node})
    print(f"{data['action']} {data['target']}: {data['result']} ({data['detail']})")


@incident_app.command("postmortem")
def postmortem_command(incident_id: str, edit: Path | None = typer.Option(
        None, "--edit", exists=True, dir_okay=False, help="Store this Markdown as the postmortem.")) -> None:
    """Print the postmortem draft (Markdown), or store an edited one (its action items are tracked)."""
    if edit is not None:
        data = _call("PUT", f"/api/v2/incidents/{incident_id}/postmortem", json={"markdown": edit.read_text()})
        print(f"{len(data['actionItems'])} action items tracked")
        return
    print(_call("GET", f"/api/v2/incidents/{incident_id}/postmortem")["markdown"])


@incident_app.command("items")
def items_command(status: str | None = typer.Option("open", "--status", help="open, done, or '' for all.")) -> None:
    """Postmortem action items across incidents."""
    params = {"status": status} if status else {}
    for item in _call("GET", "/api/v2/incidents/action-items", params=params)["actionItems"]:
        print(f"{item['incident']}\t{item['key']}\t{item['status']}\t{item['owner'] or '-'}\t{item['text']}")


@incident_app.command("quality")
def quality_command(days: float = typer.Option(7.0, "--days", min=0.01)) -> None:
    """The alert-quality report: firings, time to acknowledge, noise and flapping per alert rule."""
    print(_call("GET", "/api/v2/incidents/quality", params={"days": days})["markdown"])


def oncall_command(at: str | None = typer.Option(None, "--at", help="An ISO 8601 instant (default: now)."),
                   as_json: bool = typer.Option(False, "--json")) -> None:
    """Who is on call: each schedule's person, and whom each escalation tier pages."""
    data = _call("GET", "/api/v2/oncall", params={"at": at} if at else {})
    if as_json:
        print(json.dumps(data, indent=2))
        return
    print(f"On call at {data['at']}:")
    for name, user in data["schedules"].items():
        print(f"  schedule {name}: {user or 'nobody'}")
    for name, tiers in data["policies"].items():
        default = " (default)" if name == data.get("defaultPolicy") else ""
        print(f"  policy {name}{default}:")
        for t in tiers:
            print(f"    tier {t['level']}: {', '.join(t['users']) or 'nobody'} (then wait {t['delayS']:g} s)")
