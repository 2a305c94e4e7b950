"""The storage REST API (/api/v2/storages, the groups' storage grants) over an in-process app: who
may do what, what a submission naming storage gets, what a task's launch carries, and a config's
files (streamed up and down, traversal refused, read-only mounts, the upload limit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6, job_text

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.mounts.table import MountTable
from apiary.settings import Settings
from apiary.spec.cluster import load_cluster_config
from apiary.storage.files import StorageFiles
from apiary.storage.service import StorageService
from apiary.store import make_engine, migrate, session_factory

S = "/api/v2/storages"
LIMIT = 64 * 1024


class World:
    def __init__(self, tmp: Path) -> None:
        self.engine = make_engine(f"sqlite:///{tmp}/a.db")
        migrate(self.engine)
        self.plane = ControlPlane(session_factory(self.engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                                  tmp / "logs")
        directory = Directory(self.plane.sessions)
        p = Principals(directory, ["default", "vc1"])
        directory.create_group("team-b", virtual_clusters=["default"])
        self.h = {"alice": bearer(p.user("alice")), "bob": bearer(p.user("bob", groups=("team-b",))),
                  "admin": bearer(p.admin()), "agent": bearer(p.agent("hostname-carol"))}
        self.root = tmp / "share"
        self.root.mkdir()
        storage = StorageService(self.plane.sessions)
        files = StorageFiles(storage, MountTable(tmp / "mounts"), max_upload_bytes=LIMIT)
        settings = Settings(storage_max_upload_bytes=LIMIT)
        self.c = TestClient(create_app(self.plane, directory=directory, storage=storage, storage_files=files,
                                       settings=settings))
        self.c.__enter__()
        self.ok("PUT", f"{S}/servers/local1", "admin", json={"type": "local", "data": {"rootPath": str(self.root)}})
        self.ok("PUT", f"{S}/configs/share", "admin", json={"mountInfos": [
            {"mountPoint": "/mnt/share", "server": "local1", "path": "team", "permission": "rw"}]})
        self.ok("PUT", f"{S}/configs/seed", "admin", json={"mountInfos": [
            {"mountPoint": "/mnt/seed", "server": "local1", "path": "seed", "permission": "ro"}]})
        self.ok("PUT", "/api/v2/groups/default/storageConfigs/share", "admin")
        self.ok("PUT", "/api/v2/groups/default/storageConfigs/seed", "admin")

    def ok(self, method: str, path: str, who: str, **kw) -> dict | list | None:
        r = self.c.request(method, path, headers={**self.h[who], **kw.pop("headers", {})}, **kw)
        assert r.status_code < 300, r.text
        return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else None

    def status(self, method: str, path: str, who: str, **kw) -> int:
        return self.c.request(method, path, headers={**self.h[who], **kw.pop("headers", {})}, **kw).status_code


@pytest.fixture
def w(tmp_path: Path):
    world = World(tmp_path)
    yield world
    world.c.__exit__(None, None, None)
    world.engine.dispose()


def _job(name: str, extras: dict) -> str:
    doc = yaml.safe_load(job_text(0))
    doc["name"] = name
    doc["defaults"] = {"virtualCluster": "default"}
    doc["extras"] = extras
    return yaml.safe_dump(doc, sort_keys=False)


def test_who_sees_which_config(w: World) -> None:
    assert [c["name"] for c in w.ok("GET", f"{S}/configs", "alice")] == ["seed", "share"]
    assert w.ok("GET", f"{S}/configs", "bob") == []
    assert w.status("GET", f"{S}/configs/share", "bob") == 403
    assert w.status("GET", f"{S}/configs/nope", "alice") == 404
    assert w.status("GET", f"{S}/servers", "alice") == 403
    assert w.status("PUT", f"{S}/configs/x", "alice", json={"mountInfos": []}) == 403
    assert w.ok("GET", "/api/v2/me", "alice")["storageConfigs"] == ["seed", "share"]
    r = w.c.put(f"{S}/configs/bad", headers=w.h["admin"],
                json={"mountInfos": [{"mountPoint": "/etc", "server": "local1"}]})
    assert r.status_code == 400 and r.json()["field"] == "mountInfos[0].mountPoint"


def test_submission_names_storage_as_openpai_does(w: World) -> None:
    plugin = {"com.microsoft.pai.runtimeplugin": [{"plugin": "teamwise_storage",
                                                   "parameters": {"storageConfigNames": ["share"]}}]}
    text = {"Content-Type": "text/yaml"}
    assert w.c.post("/api/v2/jobs", content=_job("a1", plugin), headers={**w.h["alice"], **text}).status_code == 202
    assert w.c.post("/api/v2/jobs", content=_job("a2", {"storages": [{"name": "share", "mountPath": "/data"}]}),
                    headers={**w.h["alice"], **text}).status_code == 202
    r = w.c.post("/api/v2/jobs", content=_job("b1", plugin), headers={**w.h["bob"], **text})
    assert r.status_code == 403 and "share" in r.json()["message"]
    r = w.c.post("/api/v2/jobs", content=_job("b2", {"storages": [{"name": "nope"}]}), headers={**w.h["bob"], **text})
    assert r.status_code == 400 and r.json()["field"] == "extras.storages[0].name"


def test_a_launch_carries_the_planned_mounts(w: World) -> None:
    w.c.post("/api/v2/jobs", content=_job("m1", {"storages": [{"name": "share", "mountPath": "/data"}]}),
             headers={**w.h["alice"], "Content-Type": "text/yaml"})
    w.c.post("/api/v2/nodes/hostname-carol/status", headers=w.h["agent"],
             json={"agentId": "t", "gpus": 1, "simulatedGpus": True, "runs": []})
    w.ok("POST", "/api/v2/scheduler/cycle", "admin")
    got = w.ok("GET", "/api/v2/nodes/hostname-carol/assignments", "agent")["assignments"]
    assert [a["launch"]["mounts"] for a in got] == [[{
        "config": "share", "server": {"name": "local1", "type": "local", "data": {"rootPath": str(w.root)}},
        "path": "team", "mountPoint": "/data", "readOnly": False}]]
    # A grant revoked after submission: the next launch fails with the reason, it mounts nothing.
    w.ok("PUT", "/api/v2/groups/admin/storageConfigs/share", "admin")  # keep a holder so the config stays
    w.ok("DELETE", "/api/v2/groups/default/storageConfigs/share", "admin")
    w.plane.agents.plan_mounts.__self__._grants.clear()  # the planner's 5 s memory of alice's grants
    got = w.ok("GET", "/api/v2/nodes/hostname-carol/assignments", "agent")["assignments"]
    assert "mounts" not in got[0]["launch"] and "no longer granted" in got[0]["launch"]["mountError"]


def test_files_up_and_down(w: World, tmp_path: Path) -> None:
    blob = os.urandom(40_000)
    got = w.ok("PUT", f"{S}/configs/share/files", "alice", params={"path": "data/x.bin"}, content=blob,
               headers={"Content-Type": "application/octet-stream"})
    assert got == {"path": "data/x.bin", "size": len(blob)}
    assert (w.root / "team" / "data" / "x.bin").read_bytes() == blob
    entries = w.ok("GET", f"{S}/configs/share/list", "alice", params={"path": "data"})
    assert [(e["name"], e["type"], e["size"]) for e in entries] == [("x.bin", "file", len(blob))]
    r = w.c.get(f"{S}/configs/share/files", params={"path": "data/x.bin"}, headers=w.h["alice"])
    assert r.status_code == 200 and r.content == blob and r.headers["content-length"] == str(len(blob))
    assert w.status("GET", f"{S}/configs/share/files", "bob", params={"path": "data/x.bin"}) == 403
    assert w.status("PUT", f"{S}/configs/share/files", "bob", params={"path": "y"}, content=b"y") == 403
    assert w.status("DELETE", f"{S}/configs/share/files", "alice", params={"path": "data/x.bin"}) == 204
    assert not (w.root / "team" / "data" / "x.bin").exists()


def test_traversal_is_refused(w: World) -> None:
    (w.root / "secret").write_text("no")
    (w.root / "team").mkdir(exist_ok=True)
    os.symlink("/etc", w.root / "team" / "etc")
    os.symlink("../secret", w.root / "team" / "up")
    for path in ("../secret", "/etc/passwd", "etc/passwd", "up", "data/../../secret"):
        r = w.c.get(f"{S}/configs/share/files", params={"path": path}, headers=w.h["alice"])
        assert r.status_code in (400, 403, 404), (path, r.status_code, r.text)
        assert b"no" != r.content and b"root:" not in r.content
    r = w.c.put(f"{S}/configs/share/files", params={"path": "etc/evil"}, content=b"x", headers=w.h["alice"])
    assert r.status_code in (400, 403, 404) and not Path("/etc/evil").exists()


def test_read_only_configs_are_written_by_admins_only(w: World) -> None:
    assert w.status("PUT", f"{S}/configs/seed/files", "alice", params={"path": "x"}, content=b"x") == 403
    w.ok("PUT", f"{S}/configs/seed/files", "admin", params={"path": "x"}, content=b"x")
    assert w.c.get(f"{S}/configs/seed/files", params={"path": "x"}, headers=w.h["alice"]).content == b"x"
    assert w.status("DELETE", f"{S}/configs/seed/files", "alice", params={"path": "x"}) == 403


def test_an_upload_over_the_limit_is_413_and_leaves_nothing(w: World) -> None:
    r = w.c.put(f"{S}/configs/share/files", params={"path": "big"}, content=b"x" * (LIMIT + 1), headers=w.h["alice"])
    assert r.status_code == 413
    def chunks():
        for _ in range(LIMIT // 4096 + 2):
            yield b"y" * 4096
    r = w.c.put(f"{S}/configs/share/files", params={"path": "big2"}, content=chunks(), headers=w.h["alice"])
    assert r.status_code == 413
    team = w.root / "team"
    assert not team.exists() or list(team.iterdir()) == []
