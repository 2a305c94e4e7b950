"""Job templates over the REST API (/api/v2/templates) of an in-process app: publish, curate,
visibility (a group-restricted template is invisible and unrunnable for another group: 404), runs
submitted as the caller through the job submission path (VC grants apply), the model resolver, and
the shipped templates seeded once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6

from apiary.api import create_app
from apiary.auth import Directory
from apiary.auth.bootstrap import ADMIN_USER
from apiary.control import ControlPlane
from apiary.errors import NotFoundError
from apiary.marketplace.templates import TemplateService
from apiary.spec.cluster import load_cluster_config
from apiary.store import Job, make_engine, migrate, session_factory
from apiary.wiring import SHIPPED_TEMPLATES, bootstrap_templates

T = "/api/v2/templates"


def job_yaml(name: str = "train", vc: str = "default", parameters: dict[str, Any] | None = None,
             command: str = "echo epochs=<% $parameters.epochs %>") -> str:
    return yaml.safe_dump({
        "protocolVersion": 2, "name": name, "type": "job",
        "parameters": {"epochs": 2, "lr": 0.1} if parameters is None else parameters,
        "prerequisites": [{"protocolVersion": 2, "name": "img", "type": "dockerimage", "uri": "python:3.11"}],
        "taskRoles": {"train": {"instances": 1, "dockerImage": "img",
                                "resourcePerInstance": {"cpu": 1, "memoryMB": 512, "gpu": 1},
                                "commands": [command]}},
        "defaults": {"virtualCluster": vc},
    }, sort_keys=False)


def doc(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "summary": f"{name} summary", "tags": ["demo"], "job": job_yaml(), **extra}


class World:
    """Lab 6's two VCs; alice and eve (group default: VC default), carol (team-a: VC default),
    bob (team-b: VC vc1), the admin ``root``; the bridge's token."""

    def __init__(self, tmp: Path) -> None:
        engine = make_engine(f"sqlite:///{tmp}/a.db")
        migrate(engine)
        self.plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                                  tmp / "logs")
        directory = Directory(self.plane.sessions)
        p = Principals(directory, ["default"])
        directory.create_group("team-a", virtual_clusters=["default"])
        directory.create_group("team-b", virtual_clusters=["vc1"])
        self.h = {"alice": bearer(p.user("alice")), "eve": bearer(p.user("eve")),
                  "carol": bearer(p.user("carol", groups=("team-a",))),
                  "bob": bearer(p.user("bob", groups=("team-b",))), "admin": bearer(p.admin()),
                  "bridge": bearer(p.service("bridge")), "agent": bearer(p.agent("hostname-carol"))}
        self.templates = TemplateService(self.plane.sessions)
        self.c = TestClient(create_app(self.plane, directory=directory, templates=self.templates))
        self.c.__enter__()

    def call(self, method: str, path: str, who: str, **kw: Any) -> Any:
        return self.c.request(method, path, headers={**self.h[who], **kw.pop("headers", {})}, **kw)

    def ok(self, method: str, path: str, who: str, **kw: Any) -> Any:
        r = self.call(method, path, who, **kw)
        assert r.status_code < 300, r.text
        return r.json() if r.content else None

    def spec(self, job_id: str) -> dict[str, Any]:
        with self.plane.sessions() as s:
            row = s.get(Job, job_id)
            assert row is not None, job_id
            return yaml.safe_load(row.spec_yaml)

    def close(self) -> None:
        self.c.__exit__(None, None, None)


@pytest.fixture
def w(tmp_path: Path):
    world = World(tmp_path)
    yield world
    world.close()


def test_publish_get_list_and_run_as_the_caller(w: World) -> None:
    t = w.ok("POST", T, "alice", json=doc("train", description="# Train\nMarkdown."))
    assert (t["owner"], t["official"], t["jobName"]) == ("alice", False, "train")
    assert [(p["name"], p["type"], p["default"]) for p in t["parameters"]] == [("epochs", "integer", 2),
                                                                              ("lr", "number", 0.1)]
    assert w.ok("GET", f"{T}/train", "eve")["description"] == "# Train\nMarkdown."
    assert [x["name"] for x in w.ok("GET", T, "eve")] == ["train"]

    job = w.ok("POST", f"{T}/train/runs", "eve", json={"parameters": {"epochs": "5"}})
    assert job["id"].startswith("eve~train-") and job["state"] == "WAITING"
    spec = w.spec(job["id"])
    assert spec["parameters"] == {"epochs": 5, "lr": 0.1}
    job2 = w.ok("POST", f"{T}/train/runs", "eve", json={"name": "mine"})
    assert job2["id"] == "eve~mine" and w.spec("eve~mine")["parameters"]["epochs"] == 2
    # The same name again is the job route's conflict.
    assert w.call("POST", f"{T}/train/runs", "eve", json={"name": "mine"}).status_code == 409


def test_a_group_restricted_template_is_invisible_and_unrunnable_for_another_group(w: World) -> None:
    w.ok("POST", T, "admin", json=doc("team-only", visibility={"groups": ["team-a"]}))
    w.ok("POST", T, "admin", json=doc("vc-only", visibility={"virtualClusters": ["default"]}))
    # carol (team-a) sees and runs it; alice (group default) neither sees nor runs it: 404, as if absent.
    assert {x["name"] for x in w.ok("GET", T, "carol")} == {"team-only", "vc-only"}
    assert w.ok("POST", f"{T}/team-only/runs", "carol", json={})["id"].startswith("carol~train-")
    assert [x["name"] for x in w.ok("GET", T, "alice")] == ["vc-only"]
    for method, path, body in (("GET", f"{T}/team-only", None), ("POST", f"{T}/team-only/runs", {}),
                               ("PUT", f"{T}/team-only", {"job": job_yaml()}), ("DELETE", f"{T}/team-only", None)):
        r = w.call(method, path, "alice", json=body) if body is not None else w.call(method, path, "alice")
        assert r.status_code == 404, (method, r.text)
        assert r.json()["message"] == "Template team-only not found."
    # bob (team-b, VC vc1) does not see the VC-restricted one either; the bridge and admins see all.
    assert w.ok("GET", T, "bob") == []
    assert {x["name"] for x in w.ok("GET", T, "bridge")} == {"team-only", "vc-only"}
    # The bridge runs it only for a user who sees it.
    r = w.call("POST", f"{T}/team-only/runs", "bridge", json={}, headers={"X-Apiary-On-Behalf-Of": "alice"})
    assert r.status_code == 404
    r = w.call("POST", f"{T}/team-only/runs", "bridge", json={}, headers={"X-Apiary-On-Behalf-Of": "carol"})
    assert r.status_code == 202 and r.json()["id"].startswith("carol~")


def test_a_run_is_a_submission_by_the_caller_so_vc_grants_apply(w: World) -> None:
    w.ok("POST", T, "alice", json=doc("train"))
    r = w.call("POST", f"{T}/train/runs", "bob", json={})  # the template's VC is default; bob has vc1
    assert r.status_code == 403 and "virtual cluster default" in r.json()["message"]
    job = w.ok("POST", f"{T}/train/runs", "bob", json={"virtualCluster": "vc1"})
    assert job["id"].startswith("bob~") and w.spec(job["id"])["defaults"]["virtualCluster"] == "vc1"
    assert w.call("POST", f"{T}/train/runs", "agent", json={}).status_code == 403


def test_only_the_owner_and_admins_change_a_template_and_only_admins_mark_it_official(w: World) -> None:
    w.ok("POST", T, "alice", json=doc("train"))
    change = {"summary": "changed", "job": job_yaml(parameters={"epochs": 9})}
    assert w.call("PUT", f"{T}/train", "eve", json=change).status_code == 403
    assert w.call("DELETE", f"{T}/train", "eve").status_code == 403
    assert w.call("PUT", f"{T}/train", "alice", json={**change, "official": True}).status_code == 403
    assert w.call("POST", T, "alice", json=doc("other", official=True)).status_code == 403
    t = w.ok("PUT", f"{T}/train", "alice", json=change)
    assert (t["summary"], t["parameters"][0]["default"], t["owner"]) == ("changed", 9, "alice")
    t = w.ok("PUT", f"{T}/train", "admin", json={**change, "official": True})
    assert t["official"] and t["owner"] == "alice"
    assert w.ok("PUT", f"{T}/train", "alice", json=change)["official"]  # kept when not named
    assert w.call("PUT", f"{T}/train", "alice", json={**change, "name": "renamed"}).status_code == 400
    w.ok("POST", T, "eve", json=doc("eves"))
    assert w.call("DELETE", f"{T}/eves", "admin").status_code == 204
    assert w.call("DELETE", f"{T}/train", "alice").status_code == 204
    assert w.call("GET", f"{T}/train", "alice").status_code == 404
    assert w.call("POST", T, "bridge", json=doc("by-bridge")).status_code == 403


@pytest.mark.parametrize(("body", "field"), [
    (doc("bad", job="protocolVersion: 2\nname: x\ntype: job\ntaskRoles: {}\n"), "job.taskRoles"),
    (doc("bad", parameterSchema={"nope": {"title": "x"}}), "parameterSchema.nope"),
    (doc("bad name"), "name"),
    (doc("bad", job=job_yaml(parameters={"epochs": [1]})), "job.parameters.epochs"),
    (doc("bad", tags=["a b"]), "tags[0]"),
    ({"name": "bad"}, "job"),
    ({**doc("bad"), "colour": "red"}, "colour"),
], ids=["job-invalid", "schema-unknown-parameter", "name", "list-parameter", "tag", "no-job", "unknown-field"])
def test_publish_validation_is_a_400_naming_the_field(w: World, body: dict[str, Any], field: str) -> None:
    r = w.call("POST", T, "alice", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field or r.json()["field"].startswith(field), r.json()


def test_a_taken_name_is_a_409(w: World) -> None:
    w.ok("POST", T, "alice", json=doc("train"))
    assert w.call("POST", T, "eve", json=doc("train")).status_code == 409


@pytest.mark.parametrize(("values", "field"), [
    ({"epoch": 1}, "parameters.epoch"), ({"epochs": "many"}, "parameters.epochs"), ({"lr": True}, "parameters.lr"),
], ids=["unknown", "not-an-integer", "not-a-number"])
def test_bad_run_values_are_a_400_naming_the_parameter(w: World, values: dict[str, Any], field: str) -> None:
    w.ok("POST", T, "alice", json=doc("train"))
    r = w.call("POST", f"{T}/train/runs", "alice", json={"parameters": values})
    assert r.status_code == 400 and r.json()["field"] == field, r.text


def test_model_parameters_need_the_registry_and_resolve_for_the_caller(w: World) -> None:
    job = job_yaml(parameters={"epochs": 1, "model": "mnist/1"}, command="echo <% $parameters.model %>")
    w.ok("POST", T, "alice", json=doc("tune", job=job, parameterSchema={"model": {"type": "model"}}))
    r = w.call("POST", f"{T}/tune/runs", "eve", json={})
    assert r.status_code == 400 and r.json()["field"] == "parameters.model" and "no model registry" in r.text
    asked: list[tuple[str, str]] = []

    def resolve(ref: str, who: Any) -> str:
        asked.append((ref, who.name))
        if ref != "mnist/2":
            raise NotFoundError(f"Model version {ref} not found.")
        return "models:/mnist/2"

    w.templates.resolver = resolve
    assert w.call("POST", f"{T}/tune/runs", "eve", json={}).status_code == 404
    job_json = w.ok("POST", f"{T}/tune/runs", "eve", json={"parameters": {"model": "mnist/2"}})
    assert w.spec(job_json["id"])["parameters"]["model"] == "models:/mnist/2"
    assert asked == [("mnist/1", "eve"), ("mnist/2", "eve")]


def test_search_by_text_and_tag_official_first(w: World) -> None:
    w.ok("POST", T, "alice", json=doc("zeta", summary="Image classifier", tags=["vision"]))
    w.ok("POST", T, "alice", json=doc("alpha", summary="Language model", tags=["nlp"]))
    w.ok("POST", T, "admin", json=doc("beta", summary="Benchmarks", tags=["stress"], official=True))
    assert [x["name"] for x in w.ok("GET", T, "eve")] == ["beta", "alpha", "zeta"]
    assert [x["name"] for x in w.ok("GET", T, "eve", params={"q": "CLASSIF"})] == ["zeta"]
    assert [x["name"] for x in w.ok("GET", T, "eve", params={"q": "nl"})] == ["alpha"]
    assert [x["name"] for x in w.ok("GET", T, "eve", params={"tag": "stress"})] == ["beta"]
    assert w.ok("GET", T, "eve", params={"tag": "str"}) == []


def test_the_shipped_templates_are_seeded_once_as_the_admins_official_ones(w: World, tmp_path: Path) -> None:
    home = tmp_path / "home"
    published = bootstrap_templates(w.templates, home)
    shipped = sorted(p.stem for p in SHIPPED_TEMPLATES.glob("*.yaml"))
    assert sorted(published) == shipped and {"mnist", "gang-ssh", "jupyter", "stress"} <= set(shipped)
    listed = w.ok("GET", T, "eve")
    assert all(t["official"] and t["owner"] == ADMIN_USER for t in listed)
    assert sorted(t["name"] for t in listed) == shipped
    w.ok("DELETE", f"{T}/stress", "admin")
    assert bootstrap_templates(w.templates, home) == []  # once per home: a deleted one stays deleted
    assert "stress" not in {t["name"] for t in w.ok("GET", T, "eve")}
    job = w.ok("POST", f"{T}/mnist/runs", "eve", json={"parameters": {"epochs": 1}})
    assert w.spec(job["id"])["parameters"]["epochs"] == 1
