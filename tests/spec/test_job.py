"""OpenPAI job protocol v2 parsing: real lab jobs, rejections with field paths, templating, round trip."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from tests.support.builders import LAB6

from apiary.errors import ValidationError
from apiary.spec.job import PRIORITY_CLASSES, JobSpec, parse_job

# The project's shared folder sits beside the checkout (APIARY_SHARED overrides); Lab 6's job files
# are also copied unmodified into examples/lab6, which is what these tests read.
SHARED = Path(os.environ.get("APIARY_SHARED") or Path(__file__).resolve().parents[3] / "shared")

MINIMAL = """
protocolVersion: 2
name: minimal
type: job
prerequisites:
  - {name: img, type: dockerimage, uri: busybox}
taskRoles:
  train:
    dockerImage: img
    resourcePerInstance: {cpu: 1, memoryMB: 1024, gpu: 1}
    commands: [echo hi]
"""


def minimal(**overrides) -> dict:
    """The minimal job as data with top-level ``overrides``; a value of None deletes the key."""
    data = yaml.safe_load(MINIMAL)
    for key, value in overrides.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


def with_train(**fields) -> dict:
    """The minimal job with fields of task role ``train`` replaced (None deletes)."""
    data = minimal()
    train = data["taskRoles"]["train"]
    for key, value in fields.items():
        if value is None:
            train.pop(key, None)
        else:
            train[key] = value
    return data


def dump(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False)


# --------------------------------------------------------------------------- lab6 jobs

LAB6_EXPECTED = {
    # file: (priority class, virtual cluster, gang, instances)
    "job-config-0.yaml": ("prod", "vc1", True, 1),
    "job-config-1.yaml": ("test", "vc1", True, 1),
    "job-config-2.yaml": ("prod", "vc1", True, 1),
    "job-config-3.yaml": ("prod", "vc1", True, 1),
    "job-config-4.yaml": ("oppo", "vc1", True, 1),
    "job-config-5.yaml": ("prod", "default", True, 1),
    "job-config-6.yaml": ("prod", "default", True, 2),
    "job-config-7.yaml": ("prod", "default", False, 2),
}


def test_every_lab6_job_has_an_expectation():
    if not LAB6.is_dir():
        pytest.skip(f"{LAB6} not present (set APIARY_SHARED)")
    assert sorted(p.name for p in LAB6.glob("job-config-*.yaml")) == sorted(LAB6_EXPECTED)


@pytest.mark.parametrize(("filename", "expected"), sorted(LAB6_EXPECTED.items()), ids=sorted(LAB6_EXPECTED))
def test_lab6_job_parses_unmodified(filename, expected):
    path = LAB6 / filename
    if not path.is_file():
        pytest.skip(f"{path} not present (set APIARY_SHARED)")
    priority_class, vc, gang, instances = expected
    job = parse_job(path.read_bytes())
    assert job.name == filename.removesuffix(".yaml")
    assert job.priority_class == priority_class
    assert job.priority == PRIORITY_CLASSES[priority_class]
    assert job.virtual_cluster == vc
    assert job.gang is gang
    train = job.task_roles["train"]
    assert train.instances == instances
    assert train.resource_per_instance.gpu == 1
    assert train.resource_per_instance.memory_mb == 4096
    assert job.render_commands("train")[0].startswith("python3 examples/mnist/main.py")
    assert parse_job(job.to_yaml()) == job


def test_priority_classes_match_openpai_rest_server():
    assert PRIORITY_CLASSES == {"crit": 120, "prod": 100, "test": 10, "oppo": -1}


# --------------------------------------------------------------------------- defaults


def test_defaults_of_a_minimal_job():
    job = parse_job(MINIMAL)
    train = job.task_roles["train"]
    assert job.protocol_version == 2
    assert job.job_retry_count == 0
    assert train.instances == 1
    assert train.task_retry_count == 0
    assert train.completion.min_failed_instances == 1
    assert train.completion.min_succeeded_instances == -1
    assert job.virtual_cluster == "default"
    assert job.priority_class == "test"
    assert job.priority == 10
    assert job.gang is True
    assert job.sku_type("train") is None
    assert job.pinned_cell_id("train") is None


@pytest.mark.parametrize(
    ("data", "check"),
    [
        pytest.param(
            minimal(protocolVersion="2"), lambda j: j.protocol_version == 2, id="protocolVersion-string"
        ),
        pytest.param(
            with_train(completion={"minFailedInstances": None, "minSucceededInstances": None}),
            lambda j: (
                (
                    j.task_roles["train"].completion.min_failed_instances,
                    j.task_roles["train"].completion.min_succeeded_instances,
                )
                == (1, -1)
            ),
            id="completion-null-means-default",
        ),
        pytest.param(
            with_train(completion={"minFailedInstances": -1}),
            lambda j: j.task_roles["train"].completion.min_failed_instances == -1,
            id="minFailedInstances-minus-one",
        ),
        pytest.param(
            minimal(extras={"hivedScheduler": {}}),
            lambda j: j.priority_class == "test",
            id="hived-without-priority-is-test",
        ),
        pytest.param(
            minimal(extras={"submitFrom": "portal", "custom": {"x": 1}}),
            lambda j: j.gang and j.extras.model_extra == {"submitFrom": "portal", "custom": {"x": 1}},
            id="extras-free-form",
        ),
        pytest.param(
            minimal(
                extras={
                    "hivedScheduler": {
                        "jobPriorityClass": "crit",
                        "taskRoles": {"train": {"skuType": "K80", "pinnedCellId": "vc1-pinned"}},
                    }
                }
            ),
            lambda j: (
                (j.priority, j.sku_type("train"), j.pinned_cell_id("train")) == (120, "K80", "vc1-pinned")
            ),
            id="hived-task-role",
        ),
        pytest.param(
            minimal(parameters={"a": {"b": 1}}, secrets={"token": "s3"}),
            lambda j: j.parameters == {"a": {"b": 1}} and j.secrets == {"token": "s3"},
            id="parameters-and-secrets-free-form",
        ),
    ],
)
def test_accepted_variants(data, check):
    assert check(parse_job(dump(data)))


# --------------------------------------------------------------------------- rejections

REJECTIONS = [
    pytest.param("protocolVersion: 2\nname: [unclosed\n", "body", "line", id="broken-yaml"),
    pytest.param("- just\n- a list\n", "body", "mapping", id="not-a-mapping"),
    pytest.param("", "body", "mapping", id="empty-document"),
    pytest.param(dump(minimal(colour="blue")), "colour", "unknown field", id="unknown-top-level-field"),
    pytest.param(
        dump(with_train(gpus=2)), "taskRoles.train.gpus", "unknown field", id="unknown-task-role-field"
    ),
    pytest.param(
        dump(with_train(resourcePerInstance={"cpu": 1, "memoryMB": 1024, "gpu": -1})),
        "taskRoles.train.resourcePerInstance.gpu",
        "greater than or equal to 0",
        id="gpu-negative",
    ),
    pytest.param(
        dump(with_train(resourcePerInstance={"cpu": 1, "memoryMB": 1024})),
        "taskRoles.train.resourcePerInstance.gpu",
        "required",
        id="gpu-missing",
    ),
    pytest.param(
        dump(with_train(instances=0)),
        "taskRoles.train.instances",
        "greater than or equal to 1",
        id="instances-zero",
    ),
    pytest.param(
        dump(with_train(commands=[])), "taskRoles.train.commands", "at least 1", id="commands-empty"
    ),
    pytest.param(
        dump(minimal(taskRoles={"bad-name": minimal()["taskRoles"]["train"]})),
        "taskRoles.bad-name",
        "C variable name",
        id="task-role-name-with-dash",
    ),
    pytest.param(
        dump(minimal(taskRoles={"1st": minimal()["taskRoles"]["train"]})),
        "taskRoles.1st",
        "C variable name",
        id="task-role-name-leading-digit",
    ),
    pytest.param(dump(minimal(taskRoles={})), "taskRoles", "at least 1", id="task-roles-empty"),
    pytest.param(
        dump(minimal(extras={"hivedScheduler": {"jobPriorityClass": "urgent"}})),
        "extras.hivedScheduler.jobPriorityClass",
        "crit",
        id="bad-jobPriorityClass",
    ),
    pytest.param(
        dump(with_train(dockerImage="nope")),
        "taskRoles.train.dockerImage",
        "nope",
        id="dockerImage-names-no-prerequisite",
    ),
    pytest.param(
        dump(with_train(completion={"minFailedInstances": 0})),
        "taskRoles.train.completion.minFailedInstances",
        "-1 or at least 1",
        id="minFailedInstances-zero",
    ),
    pytest.param(
        dump(with_train(completion={"minSucceededInstances": -2})),
        "taskRoles.train.completion.minSucceededInstances",
        "-1 or at least 1",
        id="minSucceededInstances-minus-two",
    ),
    pytest.param(
        dump(minimal(extras={"hivedScheduler": {"taskRoles": {"ps": {"skuType": "K80"}}}})),
        "extras.hivedScheduler.taskRoles.ps",
        "task role",
        id="hived-names-unknown-task-role",
    ),
    pytest.param(
        dump(minimal(extras={"gangAllocation": "yes"})),
        "extras.gangAllocation",
        "boolean",
        id="gangAllocation-not-bool",
    ),
    pytest.param(dump(minimal(taskRoles=None)), "taskRoles", "required", id="missing-taskRoles"),
    pytest.param(dump(minimal(protocolVersion=1)), "protocolVersion", "2", id="protocolVersion-1"),
    pytest.param(dump(minimal(protocolVersion="v2")), "protocolVersion", "2", id="protocolVersion-v2-string"),
    pytest.param(dump(minimal(type="service")), "type", "job", id="type-not-job"),
    pytest.param(dump(minimal(name="my job")), "name", "pattern", id="name-with-space"),
    pytest.param(
        dump(minimal(jobRetryCount=-1)),
        "jobRetryCount",
        "greater than or equal to 0",
        id="jobRetryCount-negative",
    ),
    pytest.param(
        dump(minimal(prerequisites=[{"name": "img", "type": "dockerimage"}])),
        "prerequisites[0].uri",
        "required",
        id="dockerimage-without-uri",
    ),
    pytest.param(
        dump(minimal(prerequisites=[{"name": "img", "type": "zip", "uri": "x"}])),
        "prerequisites[0].type",
        "dockerimage",
        id="prerequisite-unknown-type",
    ),
    pytest.param(
        dump(
            minimal(
                prerequisites=[
                    {"name": "img", "type": "dockerimage", "uri": "a"},
                    {"name": "img", "type": "dockerimage", "uri": "b"},
                ]
            )
        ),
        "prerequisites[1].name",
        "duplicated",
        id="duplicated-prerequisite",
    ),
    pytest.param(
        dump(with_train(script="missing")),
        "taskRoles.train.script",
        "missing",
        id="script-names-no-prerequisite",
    ),
    pytest.param(
        dump(minimal(defaults={"deployment": "prod"})),
        "defaults.deployment",
        "prod",
        id="default-deployment-undefined",
    ),
    pytest.param(
        dump(minimal(deployments=[{"name": "d", "taskRoles": {"ps": {"preCommands": ["x"]}}}])),
        "deployments[0].taskRoles.ps",
        "task role",
        id="deployment-names-unknown-task-role",
    ),
    pytest.param(
        dump(with_train(resourcePerInstance={"cpu": "2", "memoryMB": 1024, "gpu": 1})),
        "taskRoles.train.resourcePerInstance.cpu",
        "integer",
        id="cpu-as-string",
    ),
]


@pytest.mark.parametrize(("text", "field", "words"), REJECTIONS)
def test_rejected_with_field(text, field, words):
    with pytest.raises(ValidationError) as info:
        parse_job(text)
    err = info.value
    assert err.field == field
    assert field in err.message
    assert words.lower() in err.message.lower()
    assert err.status_code == 400


TYPOS = [
    pytest.param(dump(minimal(jobRetryCont=1)), "jobRetryCont", ["jobRetryCount"], id="top-level"),
    pytest.param(dump(with_train(instance=2)), "taskRoles.train.instance", ["instances"], id="task-role"),
    pytest.param(dump(with_train(resourcePerInstance={"cpu": 1, "memoryMB": 1024, "gpus": 1})),
                 "taskRoles.train.resourcePerInstance.gpus", ["gpu"], id="resource-missing-the-meant-one"),
    pytest.param(dump(minimal(prerequisites=[{"name": "img", "type": "dockerimage", "uri": "busybox",
                                              "authh": "x"}])), "prerequisites[0].authh", ["auth"],
                 id="prerequisite-in-a-tagged-union"),
    pytest.param(dump(minimal(extras={"hivedScheduler": {"jobPriorityClas": "prod"}})),
                 "extras.hivedScheduler.jobPriorityClas", ["jobPriorityClass"], id="extras-hived"),
]


@pytest.mark.parametrize(("text", "field", "meant"), TYPOS)
def test_a_typo_d_field_is_a_400_that_says_which_field_was_meant(text: str, field: str, meant: list[str]) -> None:
    """The 400 names the first problem's field (here the misspelt one, or the required field it
    was meant to be) and ends with the close names of the fields allowed where the typo is."""
    with pytest.raises(ValidationError) as info:
        parse_job(text)
    assert info.value.status_code == 400 and info.value.field in (field, field.rsplit(".", 1)[0] + "." + meant[0])
    assert f"{field}: unknown field" in info.value.message
    assert info.value.message.endswith("did you mean " + " or ".join(repr(m) for m in meant) + "?"), info.value.message


def test_an_unknown_field_like_no_known_one_gets_no_suggestion() -> None:
    with pytest.raises(ValidationError) as info:
        parse_job(dump(minimal(colour="blue")))
    assert "unknown field" in info.value.message and "did you mean" not in info.value.message


def test_several_errors_are_all_listed_and_the_first_is_the_field():
    data = with_train(instances=0, resourcePerInstance={"cpu": 1, "memoryMB": 1024, "gpu": -1})
    with pytest.raises(ValidationError) as info:
        parse_job(dump(data))
    assert info.value.field == "taskRoles.train.instances"
    assert "taskRoles.train.resourcePerInstance.gpu:" in info.value.message
    assert "; " in info.value.message


def test_undecodable_bytes():
    with pytest.raises(ValidationError) as info:
        parse_job(b"name: \xff\xfe")
    assert info.value.field == "body"


# --------------------------------------------------------------------------- templating

TEMPLATED = minimal(
    parameters={"model": "resnet20", "batch": 32, "amp": True, "optim": {"lr": 0.1}},
    secrets={"token": "s3cr3t"},
    prerequisites=[
        {"name": "img", "type": "dockerimage", "uri": "busybox"},
        {"name": "code", "type": "script", "uri": "github.com/x/bench"},
        {"name": "cifar", "type": "data", "uri": ["https://example.org/cifar.tgz"]},
        {"name": "model_out", "type": "output", "uri": "hdfs://nn/models"},
    ],
)
TEMPLATED["taskRoles"]["train"].update(script="code", data="cifar", output="model_out")


@pytest.mark.parametrize(
    ("command", "rendered"),
    [
        pytest.param("train --model=<% $parameters.model %>", "train --model=resnet20", id="parameter"),
        pytest.param(
            "--bs <%$parameters.batch%> --amp <% $parameters.amp %>",
            "--bs 32 --amp true",
            id="int-and-bool-no-spaces",
        ),
        pytest.param("--lr <% $parameters.optim.lr %>", "--lr 0.1", id="nested-parameter"),
        pytest.param("git clone https://<% $secrets.token %>@x", "git clone https://s3cr3t@x", id="secret"),
        pytest.param(
            "cd <% $script.uri %> && ls <% $script.name %>", "cd github.com/x/bench && ls code", id="script"
        ),
        pytest.param("wget <% $data.uri[0] %>", "wget https://example.org/cifar.tgz", id="data-uri-index"),
        pytest.param("cp out <% $output.uri %>", "cp out hdfs://nn/models", id="output"),
        pytest.param(
            "echo $PAI_TASK_ROLE_train_HOST_LIST",
            "echo $PAI_TASK_ROLE_train_HOST_LIST",
            id="no-template-untouched",
        ),
    ],
)
def test_render_commands(command, rendered):
    data = yaml.safe_load(dump(TEMPLATED))
    data["taskRoles"]["train"]["commands"] = ["true", command]
    assert parse_job(dump(data)).render_commands("train") == ["true", rendered]


@pytest.mark.parametrize(
    ("command", "words"),
    [
        pytest.param("<% $parameters.missing %>", "missing", id="unknown-parameter"),
        pytest.param("<% $parameters.optim.momentum %>", "momentum", id="unknown-nested-parameter"),
        pytest.param("<% $secrets.nope %>", "nope", id="unknown-secret"),
        pytest.param("<% $data.uri[3] %>", "index 3", id="index-out-of-range"),
        pytest.param("<% $env.HOME %>", "$env", id="unknown-root"),
        pytest.param("<% parameters.model %>", "malformed", id="malformed-tag"),
    ],
)
def test_render_unknown_reference_names_the_line(command, words):
    data = yaml.safe_load(dump(TEMPLATED))
    data["taskRoles"]["train"]["commands"] = ["true", command]
    job = parse_job(dump(data))
    with pytest.raises(ValidationError) as info:
        job.render_commands("train")
    assert info.value.field == "taskRoles.train.commands[1]"
    assert words in info.value.message


def test_script_reference_without_script_prerequisite():
    job = parse_job(dump(with_train(commands=["cd <% $script.uri %>"])))
    with pytest.raises(ValidationError) as info:
        job.render_commands("train")
    assert info.value.field == "taskRoles.train.commands[0]"
    assert "$script" in info.value.message


def test_render_unknown_task_role():
    with pytest.raises(ValidationError) as info:
        parse_job(MINIMAL).render_commands("ps")
    assert info.value.field == "taskRoles.ps"


DEPLOYMENTS = [
    {"name": "dev", "taskRoles": {"train": {"preCommands": ["echo dev"]}}},
    {
        "name": "prod",
        "taskRoles": {
            "train": {"preCommands": ["pre1 <% $parameters.model %>", "pre2"], "postCommands": ["post1"]}
        },
    },
]


@pytest.mark.parametrize(
    ("deployments", "defaults", "expected"),
    [
        pytest.param(
            DEPLOYMENTS,
            {"deployment": "prod"},
            ["pre1 m", "pre2", "echo hi", "post1"],
            id="default-deployment-wraps-commands",
        ),
        pytest.param(DEPLOYMENTS[1:], None, ["pre1 m", "pre2", "echo hi", "post1"], id="only-deployment"),
        pytest.param(DEPLOYMENTS, None, ["echo hi"], id="several-without-default-none-active"),
        pytest.param(DEPLOYMENTS, {"deployment": "dev"}, ["echo dev", "echo hi"], id="pre-only"),
    ],
)
def test_deployment_order(deployments, defaults, expected):
    data = minimal(deployments=deployments, defaults=defaults, parameters={"model": "m"})
    assert parse_job(dump(data)).render_commands("train") == expected


def test_deployment_template_error_names_deployment_line():
    pre = ["ok", "<% $secrets.x %>"]
    data = minimal(deployments=[{"name": "d", "taskRoles": {"train": {"preCommands": pre}}}])
    with pytest.raises(ValidationError) as info:
        parse_job(dump(data)).render_commands("train")
    assert info.value.field == "deployments[0].taskRoles.train.preCommands[1]"


# --------------------------------------------------------------------------- round trip

ROUND_TRIP = {
    "minimal": minimal(),
    "templated": TEMPLATED,
    "everything": minimal(
        version="1.0",
        contributor="alice",
        description="all fields",
        jobRetryCount=2,
        prerequisites=[
            {
                "protocolVersion": "2",
                "name": "img",
                "type": "dockerimage",
                "uri": "busybox",
                "version": 3,
                "auth": {"username": "u", "password": "<% $secrets.pw %>", "registryuri": "r.io"},
            },
            {"name": "code", "type": "script", "uri": "github.com/x", "plugin": "git", "custom": "kept"},
        ],
        secrets={"pw": "p"},
        taskRoles={
            "ps": {
                "instances": 2,
                "completion": {"minFailedInstances": -1, "minSucceededInstances": 1},
                "taskRetryCount": 1,
                "dockerImage": "img",
                "script": "code",
                "prerequisites": ["code"],
                "extraContainerOptions": {"shmMB": 64, "infiniband": False},
                "resourcePerInstance": {"cpu": 2, "memoryMB": 8192, "gpu": 0, "ports": {"ssh": 1}},
                "commands": ["line one\nline two\n", "single"],
            },
        },
        deployments=[{"name": "prod", "taskRoles": {"ps": {"preCommands": ["a"], "postCommands": ["b"]}}}],
        defaults={"virtualCluster": "vc2", "deployment": "prod"},
        extras={
            "gangAllocation": False,
            "submitFrom": "cli",
            "hivedScheduler": {
                "jobPriorityClass": "oppo",
                "taskRoles": {"ps": {"skuType": "V100", "affinityGroupName": "g"}},
            },
        },
    ),
}


@pytest.mark.parametrize("data", list(ROUND_TRIP.values()), ids=list(ROUND_TRIP))
def test_round_trip(data):
    job = parse_job(dump(data))
    again = parse_job(job.to_yaml())
    assert again == job
    assert again.to_yaml() == job.to_yaml()
    assert JobSpec.model_validate(job.model_dump(by_alias=True, exclude_none=True)) == job
    assert JobSpec.model_validate(job.model_dump()) == job  # populate_by_name


def test_to_yaml_can_redact_secrets():
    job = parse_job(dump(TEMPLATED))
    redacted = yaml.safe_load(job.to_yaml(redact_secrets=True))
    assert redacted["secrets"] == {"token": "******"}
    assert "s3cr3t" not in job.to_yaml(redact_secrets=True)


def test_json_is_accepted():
    job = parse_job(json.dumps(minimal()).encode())
    assert job == parse_job(MINIMAL)


def test_examples_lab6_are_the_shared_reference_files_unmodified():
    reference = SHARED / "reference" / "lab6"
    if not reference.is_dir():
        pytest.skip(f"{reference} not present (set APIARY_SHARED)")
    for ref in sorted(reference.iterdir()):
        assert (LAB6 / ref.name).read_bytes() == ref.read_bytes(), ref.name
