"""Who may call each route: the one table (README, "Users, groups, tokens: who may do what").

:data:`ACCESS` maps every route of the API, ``(METHOD, path template)`` as the OpenAPI document
writes it, to an :class:`Access`: the principals it admits and how it refuses the others. The
routers enforce it with their dependencies (:mod:`apiary.api.auth`) and checks; the app publishes
each operation's principals in the OpenAPI document (``x-apiary-principals``); and
tests/api/test_authz.py generates a request for every operation of ``/openapi.json`` and every
kind of principal, with this table as the oracle: a route missing here fails that test, as does a
route that admits someone the table does not name. :data:`HIDDEN` lists the routes left out of the
OpenAPI document, each with the reason.

Principals (:data:`Who`), each as the README's table describes them:

============== ==========================================================================
``anyone``     no token needed
``token``      any valid token: users, admins, agents, services
``user``       any user's personal token (admins are users too)
``admin``      a member of an admin group
``owner``      the user the resource belongs to or names: a job's user, a token's subject,
               a user an incident names (or who opened it)
``vc``         a user whose groups grant the virtual cluster: the job's (to see it) or the
               submitted spec's (to submit)
``storage``    a user whose groups grant the storage config named in the path
``self``       the user named in the path
``oncall``     a user on call now (a schedule's on-call, or a user an escalation tier pages)
``agent``      the agent of the node named in the path (its own node only)
``bridge``     the Prefect bridge's service token
``alertmanager`` Alertmanager's service token
``signed``     no bearer token: a signature is the credential (GitHub's webhook secret,
               an incident notification's signed link)
``bootstrap``  a bootstrap token (``<id>.<secret>``, :mod:`apiary.auth.bootstrap_tokens`): a
               node's join only; no other token counts there, and it counts nowhere else
============== ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Who = Literal["anyone", "token", "user", "admin", "owner", "vc", "storage", "self", "oncall", "agent", "bridge",
              "alertmanager", "signed", "bootstrap"]

#: Every principal the table may name, in the README's order.
WHO: tuple[Who, ...] = ("anyone", "token", "user", "admin", "owner", "vc", "storage", "self", "oncall", "agent",
                        "bridge", "alertmanager", "signed", "bootstrap")

ON_BEHALF = "X-Apiary-On-Behalf-Of"
FLOW_RUN = "X-Apiary-Flow-Run-Id"


@dataclass(frozen=True)
class Access:
    """Who may call one route.

    ``who``: the principals admitted. ``only``: parts of a request (a header, a query parameter, a
    kind of body) that narrow it further: a request with that part is admitted only for a caller
    who is also one of ``only[part]``. ``needs``: principals ``who`` admits only with that part
    (the bridge submits only on behalf of a user). ``hidden_to``: the principals who get
    404 rather than 403 for a resource outside ``sees`` (a job neither theirs nor their VC's, a
    token not theirs: no hint that it exists). Everyone else with a valid token is refused 403, and
    a caller without one 401 (unless ``anyone``, or ``signed``, whose bad signature is a 401 or 403;
    ``bootstrap``: any other credential is a 401).
    """

    who: frozenset[Who]
    only: dict[str, frozenset[Who]] = field(default_factory=dict)
    needs: dict[Who, str] = field(default_factory=dict)
    sees: frozenset[Who] = frozenset()
    hidden_to: frozenset[Who] = frozenset()
    note: str = ""

    def principals(self) -> list[str]:
        """``who`` in :data:`WHO` order, with each narrowing part: what the OpenAPI document publishes."""
        out: list[str] = [w for w in WHO if w in self.who]
        out += [f"{part}: {', '.join(w for w in WHO if w in who)}" for part, who in self.only.items()]
        out += [f"{w} only with {part}" for w, part in self.needs.items()]
        return out


def _a(*who: Who, only: dict[str, frozenset[Who]] | None = None, needs: dict[Who, str] | None = None,
       sees: tuple[Who, ...] = (), hidden_to: tuple[Who, ...] = (), note: str = "") -> Access:
    return Access(frozenset(who), only or {}, needs or {}, frozenset(sees), frozenset(hidden_to), note)


def _only(**parts: tuple[Who, ...]) -> dict[str, frozenset[Who]]:
    return {part.replace("_", "-"): frozenset(who) for part, who in parts.items()}


_LINKERS: tuple[Who, ...] = ("admin", "bridge")
_JOB_SEES: tuple[Who, ...] = ("owner", "vc", "admin", "bridge")

#: ``(METHOD, path)`` -> who may call it. Paths as FastAPI's OpenAPI document writes them.
ACCESS: dict[tuple[str, str], Access] = {
    ("GET", "/healthz"): _a("anyone"),
    ("GET", "/metrics"): _a("anyone", note="APIARY_METRICS_PUBLIC=false: any token"),
    # jobs
    ("POST", "/api/v2/jobs"): _a(
        "admin", "vc", "bridge", only={ON_BEHALF: frozenset({"bridge"}), FLOW_RUN: frozenset(_LINKERS)},
        needs={"bridge": ON_BEHALF},
        note=f"{ON_BEHALF} names an existing user who is no admin and no service; {FLOW_RUN} a flow run no "
             f"other job holds"),
    ("GET", "/api/v2/jobs"): _a("user", "bridge", note="users see their own jobs and their VCs'"),
    ("GET", "/api/v2/jobs/{job_id}"): _a(*_JOB_SEES, sees=_JOB_SEES, hidden_to=("user",)),
    ("POST", "/api/v2/jobs/{job_id}/clone"): _a(
        "owner", "admin", "bridge", only={FLOW_RUN: frozenset(_LINKERS)}, sees=_JOB_SEES, hidden_to=("user",),
        note=f"{FLOW_RUN}: a free flow run or the source job's own (Retry)"),
    ("PUT", "/api/v2/jobs/{job_id}/executionType"): _a("owner", "admin", "bridge", sees=_JOB_SEES,
                                                        hidden_to=("user",)),
    ("PUT", "/api/v2/jobs/{job_id}/flowRun"): _a(*_LINKERS, note="a flow run no other job holds"),
    ("PUT", "/api/v2/flowRuns"): _a(*_LINKERS, note="flow runs no other job holds"),
    ("GET", "/api/v2/jobs/{job_id}/logs"): _a("owner", "admin", "bridge", sees=_JOB_SEES, hidden_to=("user",)),
    ("GET", "/api/v2/jobs/{job_id}/ssh"): _a("owner", "admin", sees=_JOB_SEES, hidden_to=("user",),
                                             note="OpenPAI's SSH info; never a private key"),
    ("POST", "/api/v2/logs/query"): _a("admin", "bridge"),
    # the proxy to a task instance's named port: its owner only (websocket upgrades of the same path too)
    **{(method, "/api/v2/jobs/{job_id}/proxy/{role}/{index}/{port}/{path}"): _a(
        "owner", sees=_JOB_SEES, hidden_to=("user",),
        note="the job's user only: admins and the bridge are refused too (the task's servers act as its owner)")
       for method in ("GET", "POST", "PUT", "PATCH", "DELETE")},
    ("GET", "/api/v2/events"): _a("user", "bridge", note="users get their own jobs' events"),
    # cluster and nodes
    ("POST", "/api/v2/scheduler/cycle"): _a("admin", "bridge"),
    ("GET", "/api/v2/cluster/status"): _a("user", "bridge"),
    ("PUT", "/api/v2/cluster/config"): _a("admin"),
    ("GET", "/api/v2/cluster/consistency"): _a("admin"),
    ("GET", "/api/v2/nodes"): _a("token"),
    ("GET", "/api/v2/nodes/{node}"): _a("token"),
    ("PUT", "/api/v2/nodes/{node}/cordon"): _a("admin"),
    ("POST", "/api/v2/nodes/{node}/faults"): _a("admin"),
    ("GET", "/api/v2/nodes/{node}/faults"): _a("admin"),
    # node agents
    ("POST", "/api/v2/nodes/{node}/status"): _a("agent"),
    ("GET", "/api/v2/nodes/{node}/assignments"): _a("agent"),
    ("POST", "/api/v2/nodes/{node}/logs"): _a("agent", note="runs placed on its node only"),
    # alerts
    ("POST", "/api/v2/alerts/webhook"): _a("alertmanager", "admin", only={"?action": frozenset({"admin"})}),
    ("GET", "/api/v2/alerts"): _a("admin"),
    # identity
    ("GET", "/api/v2/me"): _a("token"),
    ("GET", "/api/v2/users"): _a("admin"),
    ("POST", "/api/v2/users"): _a("admin"),
    ("GET", "/api/v2/users/{name}"): _a("admin", "self"),
    ("DELETE", "/api/v2/users/{name}"): _a("admin", note="never the last admin (409 LastAdminError)"),
    ("GET", "/api/v2/groups"): _a("admin"),
    ("POST", "/api/v2/groups"): _a("admin"),
    ("DELETE", "/api/v2/groups/{name}"): _a("admin", note="never the last admins' group (409 LastAdminError)"),
    ("GET", "/api/v2/users/{name}/sshKeys"): _a("admin", "self"),
    ("POST", "/api/v2/users/{name}/sshKeys"): _a("admin", "self"),
    ("DELETE", "/api/v2/users/{name}/sshKeys/{title}"): _a("admin", "self"),
    ("PUT", "/api/v2/groups/{name}/members/{user}"): _a("admin"),
    ("DELETE", "/api/v2/groups/{name}/members/{user}"): _a("admin", note="never the last admin (409)"),
    ("PUT", "/api/v2/groups/{name}/virtualClusters/{vc}"): _a("admin"),
    ("DELETE", "/api/v2/groups/{name}/virtualClusters/{vc}"): _a("admin"),
    ("PUT", "/api/v2/groups/{name}/storageConfigs/{config}"): _a("admin"),
    ("DELETE", "/api/v2/groups/{name}/storageConfigs/{config}"): _a("admin"),
    # storage
    ("GET", "/api/v2/storages/servers"): _a("admin"),
    ("GET", "/api/v2/storages/servers/{name}"): _a("admin"),
    ("PUT", "/api/v2/storages/servers/{name}"): _a("admin"),
    ("DELETE", "/api/v2/storages/servers/{name}"): _a("admin", note="no config may use it (409)"),
    ("GET", "/api/v2/storages/configs"): _a("user", note="users see the configs their groups grant"),
    ("GET", "/api/v2/storages/configs/{name}"): _a("admin", "storage"),
    ("PUT", "/api/v2/storages/configs/{name}"): _a("admin"),
    ("DELETE", "/api/v2/storages/configs/{name}"): _a("admin", note="no group may hold it (409)"),
    ("GET", "/api/v2/storages/configs/{name}/list"): _a("admin", "storage"),
    ("GET", "/api/v2/storages/configs/{name}/files"): _a("admin", "storage"),
    ("PUT", "/api/v2/storages/configs/{name}/files"): _a("admin", "storage",
                                                          note="a read-only mount info: admins only (403)"),
    ("DELETE", "/api/v2/storages/configs/{name}/files"): _a("admin", "storage",
                                                             note="a read-only mount info: admins only (403)"),
    # job templates (the marketplace): visibility hides a template from users outside it (404)
    ("GET", "/api/v2/templates"): _a("user", "bridge", note="users see the templates visible to them"),
    ("POST", "/api/v2/templates"): _a("user", only={"official": frozenset({"admin"})},
                                      note="the publisher owns it; official: admins only"),
    ("GET", "/api/v2/templates/{name}"): _a("user", "bridge", note="a template not visible to the user: 404"),
    ("PUT", "/api/v2/templates/{name}"): _a("owner", "admin", only={"official": frozenset({"admin"})},
                                            note="official: admins only"),
    ("DELETE", "/api/v2/templates/{name}"): _a("owner", "admin"),
    ("POST", "/api/v2/templates/{name}/runs"): _a(
        "admin", "vc", "bridge", only={ON_BEHALF: frozenset({"bridge"}), FLOW_RUN: frozenset(_LINKERS)},
        needs={"bridge": ON_BEHALF},
        note=f"as POST /api/v2/jobs, for the template's job; {ON_BEHALF} names a user who may see the template"),
    # the image catalogue (the marketplace): apiary/... is shared, users/<user>/... that user's
    ("GET", "/api/v2/images"): _a("user", note="users see the shared images and their own (admins: all)"),
    ("GET", "/api/v2/images/{repository}"): _a("user", note="another user's image: 404, as one that does not exist"),
    ("POST", "/api/v2/images/builds"): _a("user", only={"?shared": frozenset({"admin"})},
                                          note="pushed as users/<caller>/<name>; ?shared=true (apiary/<name>): "
                                               "admins only"),
    # the model registry (MLflow): the caller's own token goes to MLflow, whose permissions decide
    ("GET", "/api/v2/models"): _a("user", note="the registered models MLflow lets the caller read"),
    **{("GET", "/api/v2/models/{name}" + tail): _a(
        "owner", "admin", sees=("owner", "admin"), hidden_to=("user",),
        note="owner: a user MLflow lets read the model (its creator, or granted it); admins are MLflow admins; "
             "others: 404, as for a model that does not exist")
       for tail in ("", "/versions/{version}", "/versions/{version}/download")},
    ("GET", "/api/v2/mlflow/identity"): _a(
        "user", note="also a task's MLflow secret (MLFLOW_TRACKING_TOKEN) while its run is live: its job's user; "
                     "the MLflow server's plugin asks it"),
    ("GET", "/api/v2/tokens"): _a("user", "bridge", note="users list their own"),
    ("POST", "/api/v2/tokens"): _a(
        "user", only={"machine-or-other-or-unexpiring": frozenset({"admin"})},
        note="users their own expiring personal tokens; admins any token"),
    ("DELETE", "/api/v2/tokens/{token_id}"): _a("owner", "admin", sees=("owner", "admin"),
                                                 hidden_to=("user", "bridge")),
    # joining nodes
    ("POST", "/api/v2/bootstrap-tokens"): _a("admin"),
    ("GET", "/api/v2/bootstrap-tokens"): _a("admin", note="never the secrets"),
    ("DELETE", "/api/v2/bootstrap-tokens/{token_id}"): _a("admin"),
    ("GET", "/api/v2/cluster-info"): _a("anyone", note="the platform CA a joining node checks against its pinned hash"),
    ("POST", "/api/v2/nodes/{node}/join"): _a(
        "bootstrap", note="a valid bootstrap token for this node, unused; answers the node's agent token once"),
    # drills, CI/CD records
    ("POST", "/api/v2/drills/results"): _a("admin", "bridge"),
    ("GET", "/api/v2/drills"): _a("user", "bridge"),
    ("POST", "/api/v2/ci/webhooks/github"): _a("signed", note="GitHub's HMAC signature with the webhook secret"),
    ("GET", "/api/v2/ci/deliveries"): _a("admin"),
    ("POST", "/api/v2/ci/runs"): _a("admin", "bridge"),
    ("GET", "/api/v2/ci/runs"): _a("admin", "bridge"),
    ("GET", "/api/v2/ci/records"): _a("admin", "bridge"),
    ("POST", "/api/v2/deployments"): _a("admin", "bridge"),
    ("GET", "/api/v2/deployments"): _a("admin"),
    # incidents
    ("POST", "/api/v2/incidents"): _a("admin", "alertmanager", "oncall"),
    ("GET", "/api/v2/incidents"): _a("user", "bridge", note="users see the incidents that name them"),
    ("GET", "/api/v2/incidents/quality"): _a("admin"),
    ("GET", "/api/v2/incidents/action-items"): _a("admin"),
    ("POST", "/api/v2/incidents/events"): _a("admin", "bridge"),
    ("GET", "/api/v2/incidents/{incident_id}"): _a("owner", "admin", "bridge"),
    ("POST", "/api/v2/incidents/{incident_id}/actions"): _a("admin"),
    ("GET", "/api/v2/incidents/{incident_id}/postmortem"): _a("admin"),
    ("PUT", "/api/v2/incidents/{incident_id}/postmortem"): _a("admin"),
    ("POST", "/api/v2/incidents/{incident_id}/{event}"): _a("admin"),
    ("GET", "/api/v2/oncall"): _a("user", "bridge"),
}

#: Routes the OpenAPI document leaves out, with why; each still has its row in :data:`ACCESS`.
HIDDEN: dict[tuple[str, str], str] = {
    ("GET", "/openapi.json"): "the OpenAPI document itself (public)",
    ("GET", "/docs"): "Swagger UI over /openapi.json (public)",
    ("GET", "/docs/oauth2-redirect"): "Swagger UI's OAuth2 redirect page (public; Apiary uses no OAuth2)",
    ("GET", "/redoc"): "ReDoc over /openapi.json (public)",
    ("GET", "/api/v2/incidents/{incident_id}/link/{action}"):
        "a notification's signed link opens a page for a browser, not an API call; it changes nothing",
    ("POST", "/api/v2/incidents/{incident_id}/link/{action}"):
        "the button of that page: the link's signature (one incident, action and recipient) is the credential",
}

ACCESS.update({
    ("GET", "/openapi.json"): _a("anyone"),
    ("GET", "/docs"): _a("anyone"),
    ("GET", "/docs/oauth2-redirect"): _a("anyone"),
    ("GET", "/redoc"): _a("anyone"),
    ("GET", "/api/v2/incidents/{incident_id}/link/{action}"): _a("signed"),
    ("POST", "/api/v2/incidents/{incident_id}/link/{action}"): _a("signed"),
})


def access_of(method: str, path: str) -> Access:
    """The row of ``method`` ``path`` (a template as in the OpenAPI document); KeyError naming the
    route when the table has none (a new route needs its row)."""
    try:
        return ACCESS[(method.upper(), path)]
    except KeyError:
        raise KeyError(f"{method.upper()} {path} has no row in apiary.api.access.ACCESS: say who may call it") from None
