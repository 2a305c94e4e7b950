"""OpenPAI's ssh runtime plugin as a job asks for it (apiary.spec.ssh): OpenPAI's parameter names and
shapes are accepted, anything else is a 400 naming the field; the roles it applies to get an ``ssh``
port; public key lines are checked."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.support.builders import minimal_job

from apiary.control.jobssh import key_pair
from apiary.errors import ValidationError
from apiary.spec.job import parse_job
from apiary.spec.ssh import DEFAULT_BARRIER_TIMEOUT_MIN, check_public_key, check_public_keys

PLUGINS = "extras.com.microsoft.pai.runtimeplugin"
KEY = key_pair("alice@laptop")[1]


def job(*entries: dict[str, Any], **changes: Any) -> str:
    data = minimal_job("ssh", **{"taskRoles.train.instances": 2, **changes})
    data["taskRoles"]["ps"] = {**data["taskRoles"]["train"], "instances": 1}
    data.setdefault("extras", {})["com.microsoft.pai.runtimeplugin"] = list(entries)
    return json.dumps(data)


def refused(text: str) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        parse_job(text)
    return info.value


def test_openpai_s_documented_entry_is_accepted_with_its_meaning():
    spec = parse_job(job({"plugin": "ssh", "parameters": {
        "jobssh": True, "sshbarrier": True, "sshbarrierTimeout": 2, "userssh": {"type": "custom", "value": KEY}},
        "failurePolicy": "ignore"}))
    plugin = spec.ssh_plugin("train")
    assert plugin is not None and plugin.jobssh and plugin.sshbarrier and plugin.failure_policy == "ignore"
    assert plugin.barrier_timeout_s == 120.0 and plugin.user_keys == (KEY,)
    assert spec.port_names("train") == ["ssh"] and spec.port_names("ps") == ["ssh"]


def test_defaults_and_taskroles():
    spec = parse_job(job({"plugin": "ssh", "taskroles": ["ps"]}, **{"taskRoles.train.resourcePerInstance.ports":
                                                                    {"http": 1}}))
    assert spec.ssh_plugin("train") is None and spec.port_names("train") == ["http"]
    plugin = spec.ssh_plugin("ps")
    assert plugin is not None and not plugin.jobssh and plugin.barrier_timeout_s == DEFAULT_BARRIER_TIMEOUT_MIN * 60
    # OpenPAI's own test job: two entries, one per task role.
    spec = parse_job(job({"plugin": "ssh", "taskroles": ["train"], "parameters": {"jobssh": True, "sshbarrier": True}},
                         {"plugin": "ssh", "taskroles": ["ps"], "parameters": {"jobssh": True}}))
    assert spec.ssh_plugin("train").sshbarrier and not spec.ssh_plugin("ps").sshbarrier  # type: ignore[union-attr]


@pytest.mark.parametrize(("entry", "field"), [
    pytest.param({"plugin": "ssh", "parameters": {"jobSSH": True}}, f"{PLUGINS}[0].parameters.jobSSH", id="unknown"),
    pytest.param({"plugin": "ssh", "parameters": {"jobssh": "yes"}}, f"{PLUGINS}[0].parameters.jobssh", id="not-bool"),
    pytest.param({"plugin": "ssh", "parameters": {"jobssh": True, "sshbarrier": True, "sshbarrierTimeout": 0}},
                 f"{PLUGINS}[0].parameters.sshbarrierTimeout", id="timeout-zero"),
    pytest.param({"plugin": "ssh", "parameters": {"sshbarrierTimeout": "30"}},
                 f"{PLUGINS}[0].parameters.sshbarrierTimeout", id="timeout-string"),
    pytest.param({"plugin": "ssh", "parameters": {"sshbarrier": True}}, f"{PLUGINS}[0].parameters.sshbarrier",
                 id="barrier-without-jobssh"),
    pytest.param({"plugin": "ssh", "parameters": {"userssh": {"type": "system", "value": "x"}}},
                 f"{PLUGINS}[0].parameters.userssh.type", id="userssh-system"),
    pytest.param({"plugin": "ssh", "parameters": {"userssh": {"type": "custom", "value": KEY, "key": 1}}},
                 f"{PLUGINS}[0].parameters.userssh.key", id="userssh-unknown"),
    pytest.param({"plugin": "ssh", "parameters": {"userssh": {"type": "custom", "value": "command=\"x\" " + KEY}}},
                 f"{PLUGINS}[0].parameters.userssh.value", id="key-options"),
    pytest.param({"plugin": "ssh", "parameters": {"userssh": {"type": "custom", "value": "ssh-rsa AAAA"}}},
                 f"{PLUGINS}[0].parameters.userssh.value", id="key-garbage"),
    pytest.param({"plugin": "ssh", "parameters": []}, f"{PLUGINS}[0].parameters", id="parameters-list"),
    pytest.param({"plugin": "ssh", "failurePolicy": "retry"}, f"{PLUGINS}[0].failurePolicy", id="policy"),
    pytest.param({"plugin": "ssh", "taskroles": ["nope"]}, f"{PLUGINS}[0].taskroles[0]", id="taskroles-unknown"),
    pytest.param({"plugin": "ssh", "extra": 1}, f"{PLUGINS}[0].extra", id="entry-key"),
])
def test_a_bad_entry_is_refused_naming_the_field(entry, field):
    assert refused(job(entry)).field == field


def test_two_entries_for_one_role_and_jobssh_without_gang_are_refused():
    assert refused(job({"plugin": "ssh"}, {"plugin": "ssh", "taskroles": ["ps"]})).field == f"{PLUGINS}[1].taskroles"
    error = refused(job({"plugin": "ssh", "parameters": {"jobssh": True}}, **{"extras.gangAllocation": False}))
    assert error.field == f"{PLUGINS}[0].parameters.jobssh"


def test_public_keys():
    assert check_public_key(f"  {KEY}  ", "k") == KEY
    assert check_public_keys(f"{KEY}\n# a comment\n\n{key_pair('b')[1]}", "k")[0] == KEY
    assert len(check_public_keys(f"{KEY}\\n{key_pair('c')[1]}", "k")) == 2  # OpenPAI's printf %b form
    kind, blob, _ = KEY.split(" ", 2)
    for bad in (f"ssh-rsa {blob}", f"{kind} {blob} evil\x07", f"{kind} !!!", "ssh-dss AAAA", 5, f"{kind}"):
        with pytest.raises(ValidationError) as info:
            check_public_key(bad, "value")
        assert info.value.field == "value"
