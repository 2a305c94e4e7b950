"""``apiary deploy rollback``: roll a container platform back to an earlier succeeded deployment.

The history is the platform's own (``GET /api/v2/deployments?result=succeeded``, newest first,
read with the admin token in ``--home``/token). The target is the succeeded deployment before the
one the platform runs now (the newest whose images are the running ones; like ``kubectl rollout
undo``, a second rollback goes back to where the first started), or the one ``--to SHA`` names
(a unique prefix). The rollback is :func:`apiary.ci.rollout.rollout` with ``trigger=rollback``:
component by component behind the same gates, undone if a gate fails. Its record is posted back
to ``POST /api/v2/deployments``. Exit 0 only when it succeeded.

How the agent and the bridge are started (runtime, registry, image map, Prefect URL) is read from
the running containers unless an option says otherwise, so the replacements get the same arguments.
"""

from __future__ import annotations

import getpass
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from apiary.errors import ApiaryError, UserError, ValidationError

console = Console()
err = Console(stderr=True)

DEPLOYMENTS = "/api/v2/deployments"


class RollbackError(UserError):
    """The rollback cannot start (no history, no target, ambiguous --to): the message says why."""

    code = "RollbackError"


def _matches(record: dict[str, Any], running: dict[str, str]) -> bool:
    """The record's images are the running ones (on the images the platform runs)."""
    images = record.get("images") or {}
    return bool(running) and all(images.get(k) == v for k, v in running.items())


def pick_target(deployments: Sequence[dict[str, Any]], running: dict[str, str], to: str | None = None) -> dict:
    """The deployment to roll back to, from ``deployments`` (succeeded ones, newest first) and the
    ``running`` images (image key -> name). Pure.

    ``to``: the newest deployment whose sha starts with it; more than one sha matching is an error
    naming them. Otherwise: the first deployment, older than the current one (the newest whose
    images are the running ones; none: all of them), whose sha and images differ from what runs.
    Raises :class:`RollbackError`."""
    if not deployments:
        raise RollbackError("no succeeded deployment is recorded: nothing to roll back to")
    if to:
        prefix = to.strip().lower()
        found = [d for d in deployments if str(d.get("sha", "")).lower().startswith(prefix)]
        shas = sorted({str(d["sha"]) for d in found})
        if not shas:
            raise RollbackError(f"no succeeded deployment of a commit starting with {to}")
        if len(shas) > 1:
            raise RollbackError(f"--to {to} is ambiguous: it matches {', '.join(shas)}")
        return found[0]
    current = next((i for i, d in enumerate(deployments) if _matches(d, running)), None)
    current_sha = deployments[current]["sha"] if current is not None else None
    older = deployments[current + 1:] if current is not None else deployments
    for d in older:
        if d.get("sha") != current_sha and not _matches(d, running):
            return d
    where = f"the current one ({current_sha})" if current_sha else "the running images"
    raise RollbackError(f"no succeeded deployment before {where} to roll back to")


def running_settings(client: Any, name: str) -> dict[str, Any]:
    """How platform ``name``'s agent and bridge were started, read from their containers:
    ``agent_runtime``, ``registry``, ``image_map`` (a path) and ``prefect_api_url``, each present
    only when found."""
    import docker

    out: dict[str, Any] = {}
    try:
        agent = client.containers.get(f"apiary-{name}-agent")
        args = list(agent.attrs.get("Args") or [])
        for flag, key in (("--runtime", "agent_runtime"), ("--registry", "registry"), ("--image-map", "image_map")):
            if flag in args[:-1]:
                out[key] = args[args.index(flag) + 1]
        out.setdefault("agent_runtime", "process")
        if "image_map" in out:
            out["image_map"] = Path(out["image_map"])
    except docker.errors.NotFound:
        pass
    try:
        bridge = client.containers.get(f"apiary-{name}-bridge")
        env = dict(e.split("=", 1) for e in (bridge.attrs.get("Config") or {}).get("Env") or [] if "=" in e)
        if env.get("PREFECT_API_URL"):
            out["prefect_api_url"] = env["PREFECT_API_URL"]
    except docker.errors.NotFound:
        pass
    return out


def fetch_history(http: httpx.Client) -> list[dict[str, Any]]:
    """The succeeded deployments, newest first; :class:`RollbackError` when the route is missing."""
    r = http.get(DEPLOYMENTS, params={"result": "succeeded", "limit": 1000})
    if r.status_code == 404:
        raise RollbackError(f"{http.base_url}{DEPLOYMENTS} answered 404: this control plane keeps no deployment "
                            "history (it predates the deployments API), so there is nothing to pick a target from")
    if r.status_code >= 400:
        raise RollbackError(f"GET {DEPLOYMENTS} answered {r.status_code}: {r.text[:300]}")
    return list(r.json().get("deployments") or [])


def post_record(http: httpx.Client, record: dict[str, Any]) -> str | None:
    """POST the deployment record; a warning (not an error) when it could not be recorded."""
    try:
        r = http.post(DEPLOYMENTS, json=record)
    except httpx.HTTPError as exc:
        return f"the deployment was not recorded: {exc}"
    if r.status_code == 404:
        return f"the deployment was not recorded: {DEPLOYMENTS} answered 404 (no deployments API on this platform)"
    if r.status_code >= 400:
        return f"the deployment was not recorded: {r.status_code} {r.text[:300]}"
    return None


def steps_table(result: Any) -> Table:
    t = Table("component", "image", "gate", "ok", "seconds", "detail", title=f"rollback to {result.sha}")
    for s in result.steps:
        detail = s.detail.strip().splitlines()[0] if s.detail.strip() else ""
        t.add_row(s.component, s.image or "-", s.gate, "yes" if s.ok else "NO", f"{s.duration_s:.1f}", detail)
    return t


def add_rollout_commands(deploy_app: typer.Typer) -> None:
    """Register ``rollback`` on ``deploy_app`` (the ``apiary deploy`` group)."""

    @deploy_app.command("rollback")
    def rollback(
        home: Path = typer.Option(..., "--home", file_okay=False, help="The platform's APIARY_HOME on this host."),
        port: int = typer.Option(..., "--port", help="The platform's API port on 127.0.0.1."),
        name: str = typer.Option(..., "--name", help="The platform's name (its containers are apiary-NAME-*)."),
        to: str | None = typer.Option(None, "--to", help="Roll back to this commit (a unique prefix of its sha)."),
        registry: str | None = typer.Option(None, "--registry", help="Registry host:port (default: the agent's)."),
        agent_runtime: str | None = typer.Option(
            None, "--agent-runtime", help="process or docker (default: what the running agent uses)."
        ),
        prefect_api_url: str | None = typer.Option(
            None, "--prefect-api-url", help="The bridge's Prefect API (default: the running bridge's)."
        ),
        image_map: Path | None = typer.Option(None, "--image-map", help="Image map YAML (default: the agent's)."),
        canary_job: Path | None = typer.Option(
            None, "--canary-job", exists=True, dir_okay=False, help="A job YAML run after the last component."
        ),
        gate_timeout: float = typer.Option(120.0, "--gate-timeout", help="Seconds each gate may take."),
    ) -> None:
        """Roll the platform back, component by component behind health gates, to the succeeded
        deployment before the current one (or --to SHA). Exit 0 only if the rollback succeeded."""
        import docker
        from apiary.ci.containers import ContainerPlatform, PlatformImages
        from apiary.ci.rollout import rollout
        from apiary.images.daemons import docker_client

        home = home.expanduser().absolute()
        url = f"http://127.0.0.1:{port}"
        try:
            token = (home / "token").read_text(encoding="utf-8").strip()
        except OSError as exc:
            err.print(f"error: no admin token in {home / 'token'}: {exc}", markup=False, highlight=False)
            raise typer.Exit(1) from None
        http = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"})
        try:
            client = docker_client()
            found = running_settings(client, name)
            platform = ContainerPlatform(
                client, name, home, port,
                agent_runtime=agent_runtime or found.get("agent_runtime", "process"),
                image_map=image_map or found.get("image_map"),
                registry=registry or found.get("registry"),
                prefect_api_url=prefect_api_url or found.get("prefect_api_url"),
            )
            target = pick_target(fetch_history(http), platform.current_images(), to)
            try:
                images = PlatformImages.from_dict(target["images"])
            except (KeyError, TypeError) as exc:
                raise ValidationError("images", f"deployment {target.get('id')} names no {exc} image") from exc
            console.print(f"rolling {name} back to {target['sha']} (deployment {target.get('id')}, "
                          f"{target.get('finishedAt')})", highlight=False)
            result = rollout(platform, images, sha=str(target["sha"]), actor=getpass.getuser(), trigger="rollback",
                             canary_job=canary_job.read_text() if canary_job else None, gate_timeout_s=gate_timeout)
            warning = post_record(http, result.to_record())
        except (ApiaryError, httpx.HTTPError, docker.errors.DockerException) as exc:
            message = exc.message if isinstance(exc, ApiaryError) else f"{type(exc).__name__}: {exc}"
            err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        finally:
            http.close()
        console.print(steps_table(result))
        if warning:
            err.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)
        console.print(f"result: {result.result}" + (f" ({result.reason})" if result.reason else ""),
                      markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(0 if result.ok else 1)
