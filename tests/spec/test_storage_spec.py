"""What storage a job names (apiary.spec.storage): OpenPAI's two forms, the defaults, the rule for
a mount point, and the 400s that name the field."""

from __future__ import annotations

import pytest
import yaml
from tests.support.builders import job_text

from apiary.errors import ValidationError
from apiary.spec.job import parse_job
from apiary.spec.storage import StorageRequest, check_mount_point, storage_requests

PLUGINS = "com.microsoft.pai.runtimeplugin"


def _job(extras: dict) -> str:
    doc = yaml.safe_load(job_text(1))
    doc["extras"] = extras
    return yaml.safe_dump(doc, sort_keys=False)


def test_neither_form_means_the_defaults() -> None:
    assert storage_requests(None) is None
    assert storage_requests({"gangAllocation": True}) is None
    # OpenPAI's plugin without storageConfigNames mounts the user's defaults too.
    assert storage_requests({PLUGINS: [{"plugin": "teamwise_storage"}]}) is None
    assert storage_requests({PLUGINS: [{"plugin": "teamwise_storage", "parameters": {}}]}) is None


def test_an_empty_list_means_none() -> None:
    assert storage_requests({"storages": []}) == ()
    assert storage_requests({PLUGINS: [{"plugin": "teamwise_storage",
                                        "parameters": {"storageConfigNames": []}}]}) == ()


def test_both_forms_merge_each_config_once_the_storages_entry_winning() -> None:
    got = parse_job(_job({
        "storages": [{"name": "home", "mountPath": "/mnt/h"}],
        PLUGINS: [{"plugin": "teamwise_storage", "parameters": {"storageConfigNames": ["PAI_SHARE", "home"]}}],
    })).storage_requests()
    assert got == (
        StorageRequest("home", "/mnt/h", "extras.storages[0].name"),
        StorageRequest("PAI_SHARE", None, f"extras.{PLUGINS}[0].parameters.storageConfigNames[0]"),
    )


@pytest.mark.parametrize(("extras", "field"), [
    ({"storages": {"name": "x"}}, "extras.storages"),
    ({"storages": [{"name": "a b"}]}, "extras.storages[0].name"),
    ({"storages": [{"name": "x", "mountPath": "relative"}]}, "extras.storages[0].mountPath"),
    ({"storages": [{"name": "x", "mountPath": "/usr/lib/x"}]}, "extras.storages[0].mountPath"),
    ({"storages": [{"name": "x", "mountPath": "/mnt/../etc"}]}, "extras.storages[0].mountPath"),
    ({"storages": [{"name": "x", "size": 1}]}, "extras.storages[0].size"),
    ({"storages": [{"name": "x"}, {"name": "x"}]}, "extras.storages[1].name"),
    ({PLUGINS: [{"plugin": "teamwise_storage", "parameters": {"storageConfigNames": "x"}}]},
     f"extras.{PLUGINS}[0].parameters.storageConfigNames"),
    ({PLUGINS: [{"plugin": "teamwise_storage", "parameters": {"storageConfigNames": ["ok", 3]}}]},
     f"extras.{PLUGINS}[0].parameters.storageConfigNames[1]"),
])
def test_a_malformed_request_is_a_400_naming_its_field(extras: dict, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_job(_job(extras))
    assert e.value.field == field


def test_teamwise_storage_is_an_implemented_plugin_and_an_unknown_one_is_refused() -> None:
    parse_job(_job({PLUGINS: [{"plugin": "teamwise_storage", "parameters": {"storageConfigNames": ["a"]}}]}))
    with pytest.raises(ValidationError) as e:
        parse_job(_job({PLUGINS: [{"plugin": "mlflow_tracker"}]}))
    assert e.value.field == f"extras.{PLUGINS}[0].plugin"


@pytest.mark.parametrize("path", ["/mnt/data", "/data", "/home/alice/work", "/opt/x"])
def test_mount_points_that_are_allowed(path: str) -> None:
    assert check_mount_point(path, "f") == path


@pytest.mark.parametrize("path", ["", "/", "mnt", "/mnt/", "/mnt//x", "/mnt/./x", "/etc", "/usr/bin", "/proc/1",
                                  "/var/lib/x", "/root", "/run/x", "/dev/shm"])
def test_mount_points_that_are_refused(path: str) -> None:
    with pytest.raises(ValidationError) as e:
        check_mount_point(path, "extras.storages[0].mountPath")
    assert e.value.field == "extras.storages[0].mountPath"


def test_failure_policy_ignore_makes_the_plugins_configs_optional() -> None:
    got = storage_requests({PLUGINS: [{"plugin": "teamwise_storage", "failurePolicy": "ignore",
                                       "parameters": {"storageConfigNames": ["a"]}}]})
    assert got is not None and got[0].optional
    with pytest.raises(ValidationError) as e:
        storage_requests({PLUGINS: [{"plugin": "teamwise_storage", "failurePolicy": "maybe",
                                     "parameters": {"storageConfigNames": ["a"]}}]})
    assert e.value.field == f"extras.{PLUGINS}[0].failurePolicy"
