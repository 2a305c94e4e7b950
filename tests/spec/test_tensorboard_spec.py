"""OpenPAI's tensorboard runtime plugin as a job asks for it (apiary.spec.tensorboard)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from tests.support.builders import minimal_job

from apiary.errors import ValidationError
from apiary.spec.job import parse_job
from apiary.spec.tensorboard import GATE

PLUGINS = "com.microsoft.pai.runtimeplugin"
BASE = f"extras.{PLUGINS}[0]"


def _job(entry: dict[str, Any], roles: tuple[str, ...] = ("train", "eval")) -> str:
    data = minimal_job("tb")
    role = data["taskRoles"].pop("train")
    data["taskRoles"] = {r: role for r in roles}
    data["extras"] = {PLUGINS: [entry]}
    return yaml.safe_dump(data, sort_keys=False)


def test_the_first_role_gets_the_named_port_and_its_instance_0_runs_tensorboard() -> None:
    spec = parse_job(_job({"plugin": "tensorboard", "parameters": {"logdir": {"runs": "/mnt/home/my runs"},
                                                                    "port": 6006}}))
    plugin = spec.tensorboard_plugin()
    assert plugin is not None and plugin.role == "train" and plugin.fail
    assert spec.port_names("train") == ["tensorboard"] and spec.port_names("eval") == []
    assert plugin.commands("train", 1) == [] and plugin.commands("eval", 0) == []
    script = "\n".join(plugin.commands("train", 0))
    assert "--logdir '/mnt/home/my runs'" in script and '--port "$PAI_CONTAINER_HOST_tensorboard_PORT_LIST"' in script
    assert '--path_prefix "/api/v2/jobs/$APIARY_JOB_ID/proxy/$PAI_CURRENT_TASK_ROLE_NAME/' in script
    assert "exit 1" in script and "APIARY_PROXY_TOKEN" in GATE
    compile(GATE, "gate", "exec")  # the gate is Python the task's python3 runs


def test_several_logdirs_a_chosen_role_and_ignore() -> None:
    spec = parse_job(_job({"plugin": "tensorboard", "taskroles": ["eval"], "failurePolicy": "ignore",
                           "parameters": {"logdir": {"a": "/x/a", "b": "/x/b"}}}))
    plugin = spec.tensorboard_plugin()
    assert plugin is not None and plugin.role == "eval" and not plugin.fail
    script = "\n".join(plugin.commands("eval", 0))
    assert "--logdir_spec a:/x/a,b:/x/b" in script and "exit 1" not in script


@pytest.mark.parametrize(("entry", "field"), [
    ({"plugin": "tensorboard"}, f"{BASE}.parameters"),
    ({"plugin": "tensorboard", "parameters": {"logdir": {}}}, f"{BASE}.parameters.logdir"),
    ({"plugin": "tensorboard", "parameters": {"logdir": "/x"}}, f"{BASE}.parameters.logdir"),
    ({"plugin": "tensorboard", "parameters": {"logdir": {"a,b": "/x"}}}, f"{BASE}.parameters.logdir"),
    ({"plugin": "tensorboard", "parameters": {"logdir": {"a": "/x,y"}}}, f"{BASE}.parameters.logdir.a"),
    ({"plugin": "tensorboard", "parameters": {"logdir": {"a": "/x"}, "port": "6006"}}, f"{BASE}.parameters.port"),
    ({"plugin": "tensorboard", "parameters": {"logdir": {"a": "/x"}, "host": "0"}}, f"{BASE}.parameters.host"),
    ({"plugin": "tensorboard", "parameters": {"logdir": {"a": "/x"}}, "failurePolicy": "x"}, f"{BASE}.failurePolicy"),
    ({"plugin": "tensorboard", "parameters": {"logdir": {"a": "/x"}}, "taskroles": ["nope"]}, f"{BASE}.taskroles[0]"),
    ({"plugin": "tensorboard", "parameters": {"logdir": {"a": "/x"}}, "when": 1}, f"{BASE}.when"),
], ids=["no-parameters", "empty-logdir", "logdir-not-a-mapping", "bad-name", "comma-path", "port-string",
        "unknown-parameter", "bad-policy", "unknown-role", "unknown-key"])
def test_a_malformed_entry_is_refused_naming_the_field(entry: dict, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_job(_job(entry))
    assert e.value.field == field


def test_two_entries_are_refused() -> None:
    entry = {"plugin": "tensorboard", "parameters": {"logdir": {"a": "/x"}}}
    data = yaml.safe_load(_job(entry))
    data["extras"][PLUGINS].append(entry)
    with pytest.raises(ValidationError) as e:
        parse_job(yaml.safe_dump(data))
    assert e.value.field == f"extras.{PLUGINS}[1].plugin"
