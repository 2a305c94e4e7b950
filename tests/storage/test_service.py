"""Storage servers and configs in the store (apiary.storage.service) and the grants beside them
(apiary.auth.directory): what is refused with which status, what a submission is checked for, and
what a task mounts."""

from __future__ import annotations

from pathlib import Path

import pytest

from apiary.auth import Directory
from apiary.errors import ConflictError, ForbiddenError, NoStorageError, ValidationError
from apiary.spec.storage import StorageRequest
from apiary.storage.service import MountPlanner, StorageService
from apiary.store import make_engine, migrate, session_factory


@pytest.fixture
def world(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path}/s.db")
    migrate(engine)
    sessions = session_factory(engine)
    storage, directory = StorageService(sessions), Directory(sessions)
    (tmp_path / "data").mkdir()
    storage.put_server("local1", "local", {"rootPath": str(tmp_path / "data")})
    storage.put_server("gfs", "glusterfs", {"address": "gfs1", "volume": "vol0"})
    directory.create_group("team-a")
    directory.create_group("team-b")
    directory.create_user("alice", groups=["team-a"])
    directory.create_user("bob", groups=["team-b"])
    yield storage, directory
    engine.dispose()


def _req(name: str, path: str | None = None, field: str = "extras.storages[0].name") -> StorageRequest:
    return StorageRequest(name, path, field)


def test_a_config_round_trips_in_openpais_shape(world) -> None:
    storage, _ = world
    got = storage.put_config("share", default=True, mount_infos=[
        {"mountPoint": "/mnt/share", "server": "gfs", "path": "teams/a", "permission": "ro"},
        {"mountPoint": "/mnt/scratch", "server": "local1"}])
    assert got == {"name": "share", "default": True, "servers": ["gfs", "local1"], "mountInfos": [
        {"mountPoint": "/mnt/share", "server": "gfs", "path": "teams/a", "permission": "ro"},
        {"mountPoint": "/mnt/scratch", "server": "local1", "path": "", "permission": "rw"}]}
    assert storage.list_configs(["share", "nope"]) == [got]
    assert storage.list_configs([]) == []


@pytest.mark.parametrize(("infos", "field"), [
    ([], "mountInfos"),
    ([{"mountPoint": "/mnt/a", "server": "nope"}], "mountInfos[0].server"),
    ([{"mountPoint": "/etc/a", "server": "gfs"}], "mountInfos[0].mountPoint"),
    ([{"mountPoint": "/mnt/a", "server": "gfs", "permission": "wo"}], "mountInfos[0].permission"),
    ([{"mountPoint": "/mnt/a", "server": "gfs", "path": "../x"}], "mountInfos[0].path"),
    ([{"mountPoint": "/mnt/a", "server": "gfs", "path": "/abs"}], "mountInfos[0].path"),
    ([{"mountPoint": "/mnt/a", "server": "gfs"}, {"mountPoint": "/mnt/a/b", "server": "gfs"}],
     "mountInfos[1].mountPoint"),
    ([{"mountPoint": "/mnt/a", "server": "gfs", "extra": 1}], "mountInfos[0].extra"),
])
def test_a_bad_config_is_a_400_naming_the_field_and_stores_nothing(world, infos: list, field: str) -> None:
    storage, _ = world
    with pytest.raises(ValidationError) as e:
        storage.put_config("bad", default=False, mount_infos=infos)
    assert e.value.field == field
    with pytest.raises(NoStorageError):
        storage.config("bad")


def test_a_server_in_use_and_a_config_granted_are_not_deleted(world) -> None:
    storage, directory = world
    storage.put_config("share", default=False, mount_infos=[{"mountPoint": "/mnt/s", "server": "gfs"}])
    directory.set_storage_grant("team-a", "share")
    with pytest.raises(ConflictError, match="share"):
        storage.delete_server("gfs")
    with pytest.raises(ConflictError, match="team-a"):
        storage.delete_config("share")
    directory.set_storage_grant("team-a", "share", False)
    storage.delete_config("share")
    storage.delete_server("gfs")
    assert [s["name"] for s in storage.list_servers()] == ["local1"]


def test_secrets_of_a_server_are_never_answered(world, tmp_path: Path) -> None:
    storage, _ = world
    key = "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAAsecretsecretsecret\n-----END OPENSSH PRIVATE KEY-----\n"
    got = storage.put_server("mine", "sshfs", {"address": "h1", "user": "u", "rootPath": "/srv", "identity": key})
    assert "secretsecret" not in str(got) and "secretsecret" not in str(storage.list_servers())
    assert storage.server("mine").data["identity"] == key  # for mounting only


def test_grants_reach_the_principal_and_the_group(world) -> None:
    storage, directory = world
    storage.put_config("share", default=False, mount_infos=[{"mountPoint": "/mnt/s", "server": "gfs"}])
    directory.set_storage_grant("team-a", "share")
    assert directory.user_principal("alice").storage_configs == frozenset({"share"})
    assert directory.user_principal("bob").storage_configs == frozenset()
    assert directory.get_group("team-a")["storageConfigs"] == ["share"]
    assert directory.storage_grants("alice") == (False, frozenset({"share"}))
    directory.delete_group("team-a")  # its grants go with it
    assert directory.user_principal("alice").storage_configs == frozenset()


def test_submission_unknown_is_400_before_ungranted_is_403(world) -> None:
    storage, _ = world
    storage.put_config("share", default=False, mount_infos=[{"mountPoint": "/mnt/s", "server": "gfs"}])
    storage.check_submit(None, admin=False, granted=frozenset())  # the defaults: chosen at launch
    storage.check_submit((_req("share"),), admin=False, granted=frozenset({"share"}))
    storage.check_submit((_req("share"),), admin=True, granted=frozenset())
    with pytest.raises(ForbiddenError, match="share"):
        storage.check_submit((_req("share"),), admin=False, granted=frozenset())
    with pytest.raises(ValidationError) as e:
        storage.check_submit((_req("share"), _req("nope", field="extras.storages[1].name")), admin=False,
                             granted=frozenset())
    assert e.value.field == "extras.storages[1].name"
    assert "share" not in e.value.reason  # configs the user may not use are not listed to them


def test_a_mount_path_replaces_the_mount_point_of_a_single_mount_config_only(world) -> None:
    storage, _ = world
    storage.put_config("two", default=False, mount_infos=[{"mountPoint": "/mnt/a", "server": "gfs"},
                                                          {"mountPoint": "/mnt/b", "server": "local1"}])
    with pytest.raises(ValidationError) as e:
        storage.check_submit((_req("two", "/mnt/x"),), admin=True, granted=frozenset())
    assert e.value.field == "extras.storages[0].mountPath"


def test_the_plan_of_a_task(world, tmp_path: Path) -> None:
    storage, directory = world
    storage.put_config("share", default=True, mount_infos=[
        {"mountPoint": "/mnt/s", "server": "gfs", "path": "a", "permission": "ro"}])
    storage.put_config("home", default=False, mount_infos=[{"mountPoint": "/mnt/home", "server": "local1"}])
    storage.put_config("other", default=True, mount_infos=[{"mountPoint": "/mnt/o", "server": "local1"}])
    directory.set_storage_grant("team-a", "share")
    directory.set_storage_grant("team-a", "home")
    planner = MountPlanner(storage, directory.storage_grants)
    # No request: the defaults alice is granted (not "other").
    assert planner.plan("alice", None) == [{
        "config": "share",
        "server": {"name": "gfs", "type": "glusterfs", "data": {"address": "gfs1", "volume": "vol0"}},
        "path": "a", "mountPoint": "/mnt/s", "readOnly": True}]
    got = planner.plan("alice", (_req("home", "/mnt/mine"),))
    assert [(m["config"], m["mountPoint"], m["readOnly"]) for m in got] == [("home", "/mnt/mine", False)]
    assert got[0]["server"]["data"] == {"rootPath": str(tmp_path / "data")}
    assert planner.plan("alice", ()) == []
    with pytest.raises(ForbiddenError):  # a grant bob never had (or one revoked since submission)
        planner.plan("bob", (_req("home"),))
    directory.set_storage_grant("team-a", "home", False)
    storage.delete_config("home")
    with pytest.raises(NoStorageError):
        MountPlanner(storage, directory.storage_grants).plan("alice", (_req("home"),))


def test_no_default_config_means_no_directory_read(world) -> None:
    storage, _ = world
    asked: list[str] = []

    def grants(user: str) -> tuple[bool, frozenset[str]]:
        asked.append(user)
        return False, frozenset()

    assert MountPlanner(storage, grants).plan("alice", None) == []
    assert asked == []
