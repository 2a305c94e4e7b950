"""A corpus of hostile requests to Apiary's REST API, each with the 4xx it must get.

Bounded input: every request here is refused with a 4xx whose
error body (``{"code", "message"[, "field"]}``) names the field or the limit (``names``), and the
platform keeps serving. tests/api/test_hostile.py replays the corpus against a live app;
``make bench`` times the same requests against a live server with :func:`send`.

The corpus assumes Lab 6's two-VC cluster (examples/lab6/hived-config-two-vcs.yaml: nodes
hostname-carol and hostname-dan, VCs ``default`` and ``vc1``) and Apiary's default limits (1 MiB
body cap, safeyaml's depth 64 / 100 aliases / 100,000 nodes, 1,000 instances per job). Who sends
each request is ``principal``: ``"admin"`` (a user in the ``admin`` group: not rate-limited, may
use every VC and route), or ``"agent"``, the node agent of :data:`NODE` (the only principal the
``/api/v2/nodes/{node}/{status,assignments,logs}`` routes accept).

Plain on purpose: bytes, strings and dicts, no test framework; :func:`send` works with a
``fastapi.testclient.TestClient`` and with a real ``httpx.Client`` alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

__all__ = ["CORPUS", "MAX_BODY_BYTES", "NODE", "Hostile", "job", "send"]

NODE = "hostname-carol"
"""The node whose agent sends the ``principal="agent"`` requests (their paths name it)."""
MAX_BODY_BYTES = 1_048_576
"""The API's default body cap (``APIARY_MAX_BODY_BYTES``): larger bodies are 413."""
_U64 = 2**64  # a huge integer: past every 64-bit column and every bound of the protocol
_I64_OVER = str(2**63)  # one past the store's largest integer, as a query parameter


@dataclass(frozen=True)
class Hostile:
    """One hostile request and the answer it must get."""

    id: str
    """Readable and unique: the test id."""
    method: str
    path: str
    """Already percent-encoded where it needs to be (``/api/v2/jobs/..%2F..%2Fetc~x``)."""
    body: bytes | None
    content_type: str | None
    """The ``Content-Type`` header; None sends none."""
    query: dict[str, str] = field(default_factory=dict)
    expect: int = 400
    """The status the API must answer (a 4xx)."""
    names: str = ""
    """A substring the error's ``message`` or ``field`` must contain: the field or the limit."""
    principal: str = "admin"
    """Who sends it: ``"admin"`` or ``"agent"`` (the agent of :data:`NODE`)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Headers of the request itself, besides ``Content-Type`` and the principal's."""


def send(client: Any, case: Hostile, headers: dict[str, str] | None = None) -> httpx.Response:
    """Send ``case`` with ``client`` (a TestClient or an ``httpx.Client`` with a base URL) and the
    caller's ``headers`` (the principal's ``Authorization``); returns the response."""
    sent = {**case.headers, **(headers or {})}
    if case.content_type is not None:
        sent["Content-Type"] = case.content_type
    return client.request(case.method, case.path, params=case.query or None, content=case.body, headers=sent)


# --------------------------------------------------------------------------- builders


def job(**changes: Any) -> dict[str, Any]:
    """A valid job (VC ``default``, one 1-GPU instance) as data, with top-level ``changes``;
    ``taskRoles.train`` keys go in ``train={...}`` and its resources in ``resources={...}``."""
    train_changes = changes.pop("train", {})
    resources = changes.pop("resources", {})
    doc: dict[str, Any] = {
        "protocolVersion": 2,
        "name": "hostile",
        "type": "job",
        "prerequisites": [{"name": "img", "type": "dockerimage", "uri": "openpai/pai.example.pytorch"}],
        "taskRoles": {
            "train": {
                "instances": 1,
                "dockerImage": "img",
                "resourcePerInstance": {"cpu": 1, "memoryMB": 1024, "gpu": 1, **resources},
                "commands": ["sleep 1"],
                **train_changes,
            }
        },
        "defaults": {"virtualCluster": "default"},
        **changes,
    }
    return doc


def _yaml(doc: dict[str, Any]) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode()


def _submit(id: str, body: bytes, names: str, *, expect: int = 400,  # noqa: A002 - the field's name
            content_type: str | None = "text/yaml") -> Hostile:
    return Hostile(id, "POST", "/api/v2/jobs", body, content_type, expect=expect, names=names)


def _config(id: str, body: bytes, names: str, expect: int = 400) -> Hostile:  # noqa: A002
    return Hostile(id, "PUT", "/api/v2/cluster/config", body, "text/yaml", expect=expect, names=names)


def _json(data: Any) -> bytes:
    return json.dumps(data).encode()


_VALID = _yaml(job())
# "Billion laughs": nine levels of nine aliases, 9**9 strings once expanded.
_LAUGHS = b'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + b"".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n".encode() for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)
# Quadratic blowup: one 900 KB string, anchored once and aliased 99 times in the job's commands
# (few nodes, few aliases, 89 million characters once expanded).
_QUADRATIC = (
    b"protocolVersion: 2\nname: hostile\ntype: job\n"
    b'parameters: {long: &long "' + b"x" * 900_000 + b'"}\n'
    b"prerequisites: [{name: img, type: dockerimage, uri: openpai/pai.example.pytorch}]\n"
    b"taskRoles:\n  train:\n    dockerImage: img\n    resourcePerInstance: {cpu: 1, memoryMB: 1024, gpu: 1}\n"
    b"    commands: [" + b", ".join([b"*long"] * 99) + b"]\n"
)
_NESTED_EXTRAS = _VALID + b"extras: {deep: " + b"[" * 5_000 + b"]" * 5_000 + b"}\n"
_DUPLICATE_NAME = b"name: first\n" + _VALID
_DUPLICATE_ROLE = _VALID.replace(b"taskRoles:\n", b"taskRoles:\n  train: {}\n", 1)
_ALERT = {"status": "firing", "labels": {"alertname": "ApiaryHostile"}, "startsAt": "2026-11-25T10:00:00Z"}
_CONFIG_OK_PREFIX = b"physicalCluster:\n  skuTypes: {GPU-C: {gpu: 1}}\n"


def _gang_free_job(instances: int) -> bytes:
    return _yaml(job(train={"instances": instances}, resources={"gpu": 0}, extras={"gangAllocation": False}))


# --------------------------------------------------------------------------- the corpus

CORPUS: list[Hostile] = [
    # ---- YAML structure: depth, aliases, size (safeyaml: depth 64, 100 aliases, 100,000 nodes)
    _submit("yaml-flow-nesting-5000", b"[" * 5_000 + b"]" * 5_000, "nesting deeper than 64"),
    _submit("yaml-flow-nesting-1000000", b"[" * 1_000_000, "nesting deeper than 64"),
    _submit("yaml-block-nesting-5000", b"- " * 5_000 + b"x\n", "nesting deeper than 64"),
    _submit("yaml-block-nesting-1000000", b"- " * 1_000_000 + b"x\n", str(MAX_BODY_BYTES), expect=413),
    _submit("yaml-nesting-in-extras-5000", _NESTED_EXTRAS, "nesting deeper than 64"),
    _submit("json-nesting-5000", b"[" * 5_000 + b"]" * 5_000, "nesting deeper than 64",
            content_type="application/json"),
    _submit("yaml-billion-laughs", _LAUGHS, "more than 100000 nodes"),
    _submit("yaml-quadratic-blowup", _QUADRATIC, "characters of text"),
    _submit("yaml-101-aliases", b"a: &x 1\nb: [" + b", ".join([b"*x"] * 101) + b"]\n", "more than 100 YAML aliases"),
    _submit("yaml-recursive-alias", b"a: &a [1, *a]\n", "contains it"),
    _submit("yaml-python-object-tag", b"!!python/object/apply:os.system ['echo pwned']\n", "python/object"),
    _submit("yaml-python-object-in-field", _VALID.replace(b"name: hostile", b"name: !!python/object:os.Popen {}"),
            "python/object"),
    _submit("yaml-5000-digit-integer", _VALID + b"jobRetryCount: 1" + b"0" * 5_000 + b"\n", "!!int"),
    _submit("yaml-duplicate-key-name", _DUPLICATE_NAME, "duplicate key 'name'"),
    _submit("yaml-duplicate-key-task-role", _DUPLICATE_ROLE, "duplicate key 'train'"),
    # ---- the body as a whole: size (1 MiB cap), encoding, type
    _submit("body-10-mb", b"#" * 10_000_000, str(MAX_BODY_BYTES), expect=413),
    _submit("body-1-mib-plus-1-byte", b"#" * (MAX_BODY_BYTES + 1), str(MAX_BODY_BYTES), expect=413),
    _submit("body-not-utf-8", _VALID.replace(b"hostile", b"host\xff\xfe"), "not UTF-8"),
    _submit("body-utf-16", b"\xff\xfe" + _VALID.decode().encode("utf-16-le"), "not UTF-8"),
    _submit("body-empty", b"", "body"),
    _submit("json-body-a-list", _json([job()]), "mapping", content_type="application/json"),
    _submit("json-body-a-number", b"12345678901234567890", "mapping", content_type="application/json"),
    _submit("yaml-body-a-string", b"just some text\n", "mapping"),
    _submit("wrong-content-type-form", b"name=hostile&type=job", "mapping",
            content_type="application/x-www-form-urlencoded"),
    _submit("wrong-content-type-png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not UTF-8", content_type="image/png"),
    # ---- protocol integers (apiary.spec.job MAX_*) and the per-job instance cap (1,000)
    _submit("huge-jobRetryCount", _yaml(job(jobRetryCount=_U64)), "jobRetryCount"),
    _submit("huge-taskRetryCount", _yaml(job(train={"taskRetryCount": _U64})), "taskRetryCount"),
    _submit("huge-instances", _yaml(job(train={"instances": _U64})), "instances"),
    _submit("huge-cpu", _yaml(job(resources={"cpu": _U64})), "resourcePerInstance.cpu"),
    _submit("huge-memoryMB", _yaml(job(resources={"memoryMB": _U64})), "resourcePerInstance.memoryMB"),
    _submit("huge-gpu", _yaml(job(resources={"gpu": _U64})), "resourcePerInstance.gpu"),
    _submit("negative-gpu", _yaml(job(resources={"gpu": -1})), "resourcePerInstance.gpu"),
    _submit("instances-50000-not-gang", _gang_free_job(50_000), "taskRoles"),
    # ---- names: unicode, path characters, NUL, ../
    _submit("job-name-dot-dot-slash", _yaml(job(name="../../etc/passwd")), "name"),
    _submit("job-name-unicode", _yaml(job(name="ジョブ-𝔘𝔫𝔦𝔠𝔬𝔡𝔢")), "name"),
    _submit("job-name-nul", _VALID.replace(b"name: hostile", b'name: "host\\0ile"'), "name"),
    _submit("job-name-tilde", _yaml(job(name="alice~other")), "name"),
    _submit("task-role-name-path", _VALID.replace(b"  train:", b"  ../x:"), "taskRoles"),
    _submit("task-role-name-unicode", _VALID.replace(b"  train:", "  трен:".encode()), "taskRoles"),
    Hostile("job-id-dot-dot-slash", "GET", "/api/v2/jobs/..%2F..%2Fetc~x", None, None, expect=404, names="etc~x"),
    Hostile("job-id-nul", "GET", "/api/v2/jobs/alice~a%00b", None, None, names="job_id"),
    Hostile("job-logs-of-nobody", "GET", "/api/v2/jobs/..~..%2Fx/logs", None, None, expect=404, names="logs"),
    Hostile("jobs-username-nul", "GET", "/api/v2/jobs", None, None, query={"username": "alice\x00"},
            names="username"),
    Hostile("jobs-username-too-long", "GET", "/api/v2/jobs", None, None, query={"username": "a" * 65},
            names="username"),
    # ---- integer query parameters (the store's integers are 64-bit)
    Hostile("alerts-limit-2-63", "GET", "/api/v2/alerts", None, None, query={"limit": _I64_OVER}, names="limit"),
    Hostile("alerts-limit-negative", "GET", "/api/v2/alerts", None, None, query={"limit": "-1"}, names="limit"),
    Hostile("events-after-2-63", "GET", "/api/v2/events", None, None, query={"after": _I64_OVER}, names="after"),
    Hostile("events-after-negative", "GET", "/api/v2/events", None, None, query={"after": "-1"}, names="after"),
    Hostile("events-limit-not-a-number", "GET", "/api/v2/events", None, None, query={"limit": "1e400"},
            names="limit"),
    Hostile("logs-index-2-63", "GET", "/api/v2/jobs/alice~secret-train/logs", None, None,
            query={"index": _I64_OVER}, names="index"),
    Hostile("logs-offset-2-63", "GET", "/api/v2/jobs/alice~secret-train/logs", None, None,
            query={"offset": _I64_OVER}, names="offset"),
    Hostile("logs-offset-negative", "GET", "/api/v2/jobs/alice~secret-train/logs", None, None,
            query={"offset": "-1"}, names="offset"),
    Hostile("logs-attempt-negative", "GET", "/api/v2/jobs/alice~secret-train/logs", None, None,
            query={"attempt": "-9223372036854775809"}, names="attempt"),
    Hostile("assignments-generation-2-63", "GET", f"/api/v2/nodes/{NODE}/assignments", None, None,
            query={"generation": _I64_OVER}, names="generation", principal="agent"),
    Hostile("assignments-wait-infinite", "GET", f"/api/v2/nodes/{NODE}/assignments", None, None,
            query={"generation": "0", "wait": "inf"}, names="wait", principal="agent"),
    Hostile("assignments-wait-nan", "GET", f"/api/v2/nodes/{NODE}/assignments", None, None,
            query={"generation": "0", "wait": "nan"}, names="wait", principal="agent"),
    Hostile("node-logs-offset-2-63", "POST", f"/api/v2/nodes/{NODE}/logs", b"x", "application/octet-stream",
            query={"runId": "r", "stream": "stdout", "offset": _I64_OVER}, names="offset", principal="agent"),
    # ---- the cluster config (admins only; same YAML bounds, field "config")
    _config("config-deep-nesting", b"[" * 5_000 + b"]" * 5_000, "nesting deeper than 64"),
    _config("config-alias-bomb", _LAUGHS, "nodes"),
    _config("config-duplicate-keys", _CONFIG_OK_PREFIX + b"physicalCluster: {}\n", "duplicate key 'physicalCluster'"),
    _config("config-not-utf-8", b"physicalCluster: \xff\xfe\n", "not UTF-8"),
    _config("config-child-cells-2-70", (_CONFIG_OK_PREFIX + b"  cellTypes: {NODE: {childCellType: GPU-C, "
                                        b"childCellNumber: 1180591620717411303424, isNodeLevel: true}}\n"
                                        b"  physicalCells: [{cellType: NODE, cellAddress: hostname-carol}]\n"),
            "leaf cells"),
    _config("config-python-tag", b"!!python/object/apply:os.system ['echo pwned']\n", "python/object"),
    # ---- Alertmanager's webhook (admins and the Alertmanager service)
    Hostile("alerts-100000", "POST", "/api/v2/alerts/webhook",
            _json({"status": "firing", "alerts": [_ALERT] * 100_000}), "application/json", expect=413,
            names=str(MAX_BODY_BYTES)),
    Hostile("alert-huge-label", "POST", "/api/v2/alerts/webhook",
            _json({"status": "firing", "alerts": [{**_ALERT, "labels": {"alertname": "x" * 2_000_000}}]}),
            "application/json", expect=413, names=str(MAX_BODY_BYTES)),
    Hostile("alert-label-not-a-string", "POST", "/api/v2/alerts/webhook",
            _json({"status": "firing", "alerts": [{**_ALERT, "labels": {"alertname": {"a": [1] * 1000}}}]}),
            "application/json", names="labels"),
    Hostile("alert-label-nul", "POST", "/api/v2/alerts/webhook",
            _json({"status": "firing", "alerts": [{**_ALERT, "labels": {"alertname": "a\x00b"}}]}),
            "application/json", names="alerts[0].labels.alertname"),
    Hostile("alert-label-lone-surrogate", "POST", "/api/v2/alerts/webhook",
            b'{"status": "firing", "alerts": [{"status": "firing", "labels": {"alertname": "\\ud800"}, '
            b'"startsAt": "2026-11-25T10:00:00Z"}]}', "application/json", names="alertname"),
    Hostile("alerts-json-nesting-100000", "POST", "/api/v2/alerts/webhook", b"[" * 100_000 + b"]" * 100_000,
            "application/json", names="body"),
    # ---- node agents' reports
    Hostile("node-report-20000-runs", "POST", f"/api/v2/nodes/{NODE}/status",
            json.dumps({"agentId": "a", "runs": [{"run_id": f"r{i}", "state": "running"} for i in range(20_000)]},
                       separators=(",", ":")).encode(),
            "application/json", names="runs", principal="agent"),
    Hostile("node-report-huge-gpus", "POST", f"/api/v2/nodes/{NODE}/status", _json({"agentId": "a", "gpus": _U64}),
            "application/json", names="gpus", principal="agent"),
    Hostile("node-report-huge-pid", "POST", f"/api/v2/nodes/{NODE}/status",
            _json({"agentId": "a", "runs": [{"run_id": "r", "state": "running", "pid": _U64}]}),
            "application/json", names="runs[0].pid", principal="agent"),
    Hostile("node-report-infinite-time", "POST", f"/api/v2/nodes/{NODE}/status",
            b'{"agentId": "a", "runs": [{"run_id": "r", "state": "exited", "finished_at": Infinity}]}',
            "application/json", names="finished_at", principal="agent"),
    Hostile("node-report-huge-faults-applied", "POST", f"/api/v2/nodes/{NODE}/status",
            _json({"agentId": "a", "faultsApplied": _U64}), "application/json", names="faultsApplied",
            principal="agent"),
    Hostile("node-report-nul-agent-id", "POST", f"/api/v2/nodes/{NODE}/status", _json({"agentId": "a\x00"}),
            "application/json", names="agentId", principal="agent"),
    Hostile("node-report-not-json", "POST", f"/api/v2/nodes/{NODE}/status", b"\xff\xfe{", "application/json",
            names="body", principal="agent"),
    Hostile("node-report-a-list", "POST", f"/api/v2/nodes/{NODE}/status", b"[]", "application/json",
            names="body", principal="agent"),
    Hostile("node-report-form", "POST", f"/api/v2/nodes/{NODE}/status", b"agentId=a", "multipart/form-data",
            names="body", principal="agent"),
    Hostile("fault-huge-ecc", "POST", "/api/v2/nodes/hostname-dan/faults", _json({"gpu": 0, "eccDbe": _U64}),
            "application/json", names="eccDbe"),
    Hostile("fault-infinite-temperature", "POST", "/api/v2/nodes/hostname-dan/faults",
            b'{"gpu": 0, "temp": Infinity}', "application/json", names="temp"),
    # ---- identity routes: names and token ids
    Hostile("user-name-dot-dot-slash", "POST", "/api/v2/users", _json({"username": "../x"}), "application/json",
            names="username"),
    Hostile("user-name-unicode", "POST", "/api/v2/users", _json({"username": "алиса"}), "application/json",
            names="username"),
    Hostile("user-name-nul", "POST", "/api/v2/users", _json({"username": "a\x00b"}), "application/json",
            names="username"),
    Hostile("user-email-nul", "POST", "/api/v2/users", _json({"username": "mallory", "email": "m\x00@x"}),
            "application/json", names="email"),
    Hostile("user-group-dot-dot", "POST", "/api/v2/users", _json({"username": "mallory", "groups": [".."]}),
            "application/json", names="groups"),
    Hostile("user-body-empty", "POST", "/api/v2/users", b"", "application/json", names="body"),
    Hostile("user-body-text-plain", "POST", "/api/v2/users", _json({"username": "mallory"}), "text/plain",
            names="body"),
    Hostile("user-path-dot-dot-slash", "GET", "/api/v2/users/..%2F..%2Fetc", None, None, expect=404,
            names="etc"),
    Hostile("user-path-bad-name", "DELETE", "/api/v2/users/a.b", None, None, names="name"),
    Hostile("group-name-too-long", "POST", "/api/v2/groups", _json({"groupname": "g" * 65}), "application/json",
            names="groupname"),
    Hostile("group-description-surrogate", "POST", "/api/v2/groups",
            b'{"groupname": "g1", "description": "\\udc80"}', "application/json", names="description"),
    Hostile("token-id-not-hex", "DELETE", "/api/v2/tokens/not-hex-at-all", None, None, names="token_id"),
    Hostile("token-id-upper-hex", "DELETE", "/api/v2/tokens/ABCDEF012345", None, None, names="token_id"),
    Hostile("token-lifetime-nan", "POST", "/api/v2/tokens", b'{"expiresInS": NaN}', "application/json",
            names="expiresInS"),
    Hostile("token-subject-nul", "POST", "/api/v2/tokens", _json({"subject": "alice\x00"}), "application/json",
            names="subject"),
    Hostile("token-unknown-kind", "POST", "/api/v2/tokens", _json({"kind": "root"}), "application/json",
            names="kind"),
    Hostile("flow-run-header-too-long", "POST", "/api/v2/jobs/alice~secret-train/clone", None, None,
            names="x-apiary-flow-run-id", headers={"X-Apiary-Flow-Run-Id": "f" * 10_000}),
]
"""Every hostile request (ids unique)."""
