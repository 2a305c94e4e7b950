"""No run parameter sends a token anywhere: every deployment ``apiary up`` serves (flows/serve.py's
``main()``), started with hostile parameters, against a listener on 127.0.0.1.

Whoever holds the Prefect password may start any served deployment with any parameters. Each
deployment is started here with ``api_url`` and every string parameter set to the listener's URL
(``request`` fields too; a parameter with a pattern or an enum keeps a valid value, so the run gets
past validation and does its work), with the platform's URL (``APIARY_API_URL``) pointing at a
second recorder that answers 400 to everything, so each run ends quickly. The listener must see no
``Authorization`` header and none of the tokens of ``APIARY_HOME`` (the admin's ``token``,
``credentials/*.token``), and ``api_url`` must be refused: Prefect refuses a parameter the flow
does not take. The flows run against a real, protected Prefect server (as tests/flows/test_job_flow.py).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.prefect

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Recorder:
    """An HTTP server on 127.0.0.1 that records every request and answers ``status`` with a JSON
    error body (Apiary's shape)."""

    status: int
    requests: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                rec.requests.append({"method": self.command, "path": self.path,
                                     "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
                out = json.dumps({"code": "BadRequest", "message": "refused by the test's recorder"}).encode()
                self.send_response(rec.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

            def log_message(self, *_a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def recorders() -> Iterator[tuple[Recorder, Recorder]]:
    listener, platform = Recorder(404), Recorder(400)
    yield listener, platform
    listener.close()
    platform.close()


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorders) -> dict[str, Any]:
    """An APIARY_HOME with the admin's, the bridge's, an agent's and Alertmanager's tokens, and the
    environment ``apiary up`` gives its Prefect children (APIARY_API_URL, APIARY_TOKEN = the bridge's)."""
    listener, platform = recorders
    listener.requests.clear()
    platform.requests.clear()
    home = tmp_path / "home"
    (home / "credentials").mkdir(parents=True)
    tokens = {name: f"{name}-{secrets.token_hex(16)}" for name in ("admin", "bridge", "agent", "alertmanager")}
    (home / "token").write_text(tokens["admin"])
    for name in ("bridge", "alertmanager"):
        (home / "credentials" / f"{name}.token").write_text(tokens[name])
    (home / "credentials" / "agent-node1.token").write_text(tokens["agent"])
    for var in ("APIARY_DRILL_TOKEN", "APIARY_CI_REPO_URL", "APIARY_CI_STATUS_URL", "APIARY_CI_RECORD_URL",
                "APIARY_CI_PRODUCTION", "APIARY_DRILL_SCHEDULES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("APIARY_HOME", str(home))
    monkeypatch.setenv("APIARY_API_URL", platform.url)
    monkeypatch.setenv("APIARY_TOKEN", tokens["bridge"])
    monkeypatch.setenv("APIARY_CI_WORKDIR", str(tmp_path / "ci-work"))
    monkeypatch.setenv("APIARY_CI_ARTIFACTS", str(tmp_path / "ci-artifacts"))
    monkeypatch.setenv("APIARY_DRILL_GUARD_INTERVAL_S", "0.1")
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    monkeypatch.setenv("GIT_TERMINAL_PROMPT", "0")
    monkeypatch.chdir(tmp_path)  # a flow that writes relative paths (out_dir=<url>) writes here
    return {"listener": listener, "platform": platform, "tokens": tokens}


def served_deployments() -> list[Any]:
    """What ``python flows/serve.py`` (``apiary up``) serves: its ``main()``, with Prefect's
    ``serve`` replaced by a recorder."""
    spec = importlib.util.spec_from_file_location("apiary_flows_serve_hostile", REPO / "flows" / "serve.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got: list[Any] = []
    mod.serve = lambda *deployments, **_kw: got.extend(deployments)
    mod.main()
    return got


def flow_of(deployment: Any) -> Any:
    """The flow object of ``deployment`` (entrypoint ``flows/<module>.py:<name>``; serve.py put
    flows/ on sys.path)."""
    path, name = deployment.entrypoint.split(":")
    return getattr(importlib.import_module(Path(path).stem), name)


def _schema(deployment: Any) -> dict[str, Any]:
    raw = deployment._parameter_openapi_schema
    return raw.model_dump() if hasattr(raw, "model_dump") else dict(raw)


def _pick(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null alternative of an ``anyOf`` (``str | None`` -> the string schema)."""
    for alt in prop.get("anyOf") or [prop]:
        if alt.get("type") != "null":
            return {**prop, **alt}
    return prop


def hostile_parameters(deployment: Any, url: str) -> dict[str, Any]:
    """The deployment's own parameters, then every string (and list of strings) set to ``url``,
    ``request``-like objects with every field a URL; a string with a pattern or an enum keeps a
    valid value (``alice``, its default, its first choice)."""
    params = dict(deployment.parameters or {})
    for key, raw in (_schema(deployment).get("properties") or {}).items():
        prop = _pick(raw)
        kind = prop.get("type")
        if kind == "string":
            if "enum" in prop:
                params[key] = params.get(key, prop.get("default", prop["enum"][0]))
            elif "pattern" in prop:
                params[key] = "alice"
            else:
                params[key] = url
        elif kind == "array" and (prop.get("items") or {}).get("type") == "string":
            params[key] = [url]
        elif kind == "object":
            params[key] = {"repo": url, "clone_url": url, "sha": "0" * 40, "ref": url, "kind": "pr",
                           "pr_number": 1, "sender": url, "url": url}
    return params


def run_flow(fl: Any, params: dict[str, Any]) -> Any:
    """Run ``fl`` with ``params`` as a flow run (the engine validates them first); its final state,
    or the exception that refused it."""
    try:
        out = fl(**params, return_state=True)
        return asyncio.run(out) if asyncio.iscoroutine(out) else out
    except Exception as exc:  # refused before a run: as good as ignored, for this test
        return exc


def leaks(requests: list[dict[str, Any]], tokens: dict[str, str]) -> list[str]:
    """Each request that carried an Authorization header or one of ``tokens``, said in words."""
    out = []
    for r in requests:
        text = r["path"] + json.dumps(r["headers"]) + r["body"].decode("utf-8", "replace")
        found = [name for name, tok in tokens.items() if tok in text]
        if "authorization" in r["headers"] or found:
            out.append(f"{r['method']} {r['path']} (Authorization={'authorization' in r['headers']}, tokens={found})")
    return out


#: Deployments that act through Apiary's API: a hostile run of each still reaches the platform's
#: own URL (so the test sees the flows run, and where their token goes).
TALKS_TO_THE_PLATFORM = {
    "apiary-job/submit", "apiary-job/submit-yaml", "apiary-job/job", "scheduling-loop/loop",
    "inspection/inspection", "stress-drill/nightly", "chaos-drill/weekly", "load-drill/weekly",
    "runbook/gpu-node-repair", "runbook/node-drain", "alert-quality/weekly",
}


def test_the_test_covers_every_served_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APIARY_API_URL", raising=False)
    names = {f"{d.flow_name}/{d.name}" for d in served_deployments()}
    assert names == TALKS_TO_THE_PLATFORM | {"what-if-replay/whatif", "platform-ci/pr", "platform-deploy/main"}


def test_no_served_deployment_takes_a_url_or_sends_a_token_to_one(prefect_api, world) -> None:
    listener, platform, tokens = world["listener"], world["platform"], world["tokens"]
    deployments = served_deployments()
    accepted_api_url, leaked, silent = [], {}, []
    outcomes: dict[str, Any] = {}
    for d in deployments:
        name = f"{d.flow_name}/{d.name}"
        fl = flow_of(d)
        params = hostile_parameters(d, listener.url)
        with_url = {**params, "api_url": listener.url}
        try:
            fl.validate_parameters(with_url)
        except Exception:  # refused: Prefect runs no flow with a parameter it does not take
            pass
        else:
            accepted_api_url.append(name)
            params = with_url
        assert "api_url" not in (_schema(d).get("properties") or {}) or name in accepted_api_url
        before_listener, before_platform = len(listener.requests), len(platform.requests)
        outcomes[name] = run_flow(fl, params)
        got = leaks(listener.requests[before_listener:], tokens)
        if got:
            leaked[name] = got
        if name in TALKS_TO_THE_PLATFORM and len(platform.requests) == before_platform:
            silent.append(name)
    assert not leaked, f"tokens reached the listener: {leaked}"
    assert not accepted_api_url, f"deployments that take api_url: {accepted_api_url}"
    assert not silent, f"these runs never reached the platform's own URL: {[(n, outcomes[n]) for n in silent]}"
    # The admin's token went where it belongs: the platform's configured URL.
    assert any(r["headers"].get("authorization") == f"Bearer {tokens['admin']}" for r in platform.requests)
    assert any(r["headers"].get("authorization") == f"Bearer {tokens['bridge']}" for r in platform.requests)


async def _run_logs(flow_run_id: Any) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def test_the_what_if_replay_shows_no_file_it_was_pointed_at(prefect_api, world, tmp_path: Path) -> None:
    """Its paths are the serving host's: a token file is refused (inside APIARY_HOME), and a file
    elsewhere that is not a trace fails the run without its content in the state or the logs."""
    from prefect.logging.handlers import APILogWorker

    (wi,) = [d for d in served_deployments() if d.flow_name == "what-if-replay"]
    fl = flow_of(wi)
    home = Path(os.environ["APIARY_HOME"])
    elsewhere = tmp_path / "not-a-trace"
    elsewhere.write_text("root:$6$hash-that-must-not-show:19000:0:99999:7:::\n")
    cases = {"token": (str(home / "token"), world["tokens"]["admin"]),
             "credentials": (str(home / "credentials" / "bridge.token"), world["tokens"]["bridge"]),
             "elsewhere": (str(elsewhere), "hash-that-must-not-show")}
    for name, (path, secret) in cases.items():
        state = run_flow(fl, {"trace": path})
        assert getattr(state, "is_failed", lambda: False)(), (name, state)
        assert secret not in (state.message or ""), (name, state.message)
        APILogWorker.drain_all(timeout=5)
        logs = asyncio.run(_run_logs(state.state_details.flow_run_id))
        assert logs and not [m for m in logs if secret in m], (name, logs)
