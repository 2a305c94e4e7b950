"""Input a node agent can always handle: what parse_job refuses besides the protocol's own rules.

Names match their whole pattern (no trailing newline), no string holds a NUL or a lone surrogate,
``protocolVersion`` is the integer 2 (or OpenPAI's string "2"), rendered commands are bounded
without being rendered, JSON bodies are read as JSON, and runtime plugins Apiary does not implement
are refused. A job reloaded from the store (``stored=True``) is held to the rules of its day.
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
import yaml
from tests.support.builders import minimal_job

from apiary.errors import ValidationError
from apiary.spec import safeyaml
from apiary.spec.job import parse_job

#: apiary.spec.admission's values, written out (checked below) so each test fails on its own where
#: that module is missing.
MAX_RENDERED_BYTES = 1_048_576  # the API's default body cap
RUNTIME_PLUGIN_KEY = "com.microsoft.pai.runtimeplugin"
PLUGINS = f"extras.{RUNTIME_PLUGIN_KEY}"


def test_the_limits_are_the_modules():
    from apiary.api.guards import DEFAULT_MAX_BODY_BYTES
    from apiary.spec import admission

    assert admission.MAX_RENDERED_BYTES == MAX_RENDERED_BYTES == DEFAULT_MAX_BODY_BYTES
    assert admission.RUNTIME_PLUGIN_KEY == RUNTIME_PLUGIN_KEY


def job(**changes: Any) -> dict[str, Any]:
    """A valid job as data with ``changes`` set by dotted path (``"taskRoles.train.commands"``)."""
    return minimal_job("admission", **changes)


def as_json(data: dict[str, Any]) -> str:
    """What Python's json.dumps writes: non-ASCII as \\u escapes, astral characters as surrogate pairs."""
    return json.dumps(data)


def rejection(text: str | bytes, **kwargs: Any) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        parse_job(text, **kwargs)
    return info.value


def with_role(name: str, **role_changes: Any) -> dict[str, Any]:
    data = job()
    role = {**data["taskRoles"]["train"], **role_changes}
    data["taskRoles"] = {name: role}
    return data


# --------------------------------------------------------------------------- names: the whole name


@pytest.mark.parametrize("name", ["train\n", "train\r\n", "\ntrain", "tr\nain", "train "])
def test_task_role_name_with_a_newline_is_refused(name):
    error = rejection(as_json(with_role(name)))
    assert error.field.startswith("taskRoles.") and "task role name" in error.message
    assert "\n" not in error.field  # the path stays one line: a key with a newline is written escaped
    assert (repr(name) if "\n" in name else name) in error.field


@pytest.mark.parametrize(
    ("dotted", "value", "field"),
    [
        pytest.param("name", "admission\n", "name", id="job-name"),
        pytest.param("taskRoles.train.resourcePerInstance.ports", {"ssh\n": 1}, "ports", id="port-label"),
        pytest.param("deployments", [{"name": "d\n", "taskRoles": {"train": {"preCommands": ["x"]}}}],
                     "deployments[0].name", id="deployment-name"),
        pytest.param("prerequisites", [{"name": "img\n", "type": "dockerimage", "uri": "busybox"}],
                     "prerequisites[0].name", id="prerequisite-name"),
    ],
)
def test_names_with_a_trailing_newline_are_refused(dotted, value, field):
    assert field in rejection(as_json(job(**{dotted: value}))).field


def test_probe_port_label_with_a_trailing_newline_is_refused():
    data = job(**{"taskRoles.train.resourcePerInstance.ports": {"http": 1}})
    data["extras"] = {"apiary": {"taskRoles": {"train": {
        "livenessProbe": {"tcpSocket": {"port": "http\n"}}}}}}
    assert "livenessProbe" in rejection(as_json(data)).field


def test_a_stored_job_is_held_to_the_rule_it_was_accepted_under():
    """Jobs accepted before names were full-matched still reload (the store is not made unreadable)."""
    spec = parse_job(as_json(with_role("train\n")), stored=True)
    assert list(spec.task_roles) == ["train\n"]


# --------------------------------------------------------------------------- NUL and lone surrogates


@pytest.mark.parametrize(
    ("dotted", "value", "field"),
    [
        pytest.param("taskRoles.train.commands", ["echo a\x00b"], "taskRoles.train.commands[0]", id="command"),
        pytest.param("secrets", {"token\x00": "x"}, "secrets", id="secret-key"),
        pytest.param("secrets", {"token": "x\x00y"}, "secrets.token", id="secret-value"),
        pytest.param("parameters", {"env": {"PATH": "/bin\x00"}}, "parameters.env.PATH", id="parameter-env"),
        pytest.param("description", "\x00", "description", id="description"),
        pytest.param("extras", {"note": ["ok", "n\x00"]}, "extras.note[1]", id="extras"),
        pytest.param("deployments", [{"name": "d", "taskRoles": {"train": {"preCommands": ["\x00"]}}}],
                     "deployments[0].taskRoles.train.preCommands[0]", id="pre-command"),
        pytest.param("prerequisites", [{"name": "img", "type": "dockerimage", "uri": "busy\x00box"}],
                     "prerequisites[0].uri", id="image-uri"),
    ],
)
def test_nul_is_refused_in_every_string_naming_the_field(dotted, value, field):
    for text in (as_json(job(**{dotted: value})), yaml.safe_dump(job(**{dotted: value}))):
        error = rejection(text)
        assert error.field == field and "NUL" in error.message, (error.field, error.message)


def test_a_nul_secret_value_is_not_echoed():
    error = rejection(as_json(job(secrets={"token": "hunter2\x00"})))
    assert "hunter2" not in error.message and error.field == "secrets.token"


def test_nul_in_a_key_at_the_top_is_named_as_the_body():
    data = job()
    data["x\x00"] = 1
    error = rejection(as_json(data))
    assert error.field == "body" and "NUL" in error.message and "'x\\x00'" in error.message


# --------------------------------------------------------------------------- protocolVersion


@pytest.mark.parametrize("value", [2.0, True, 2.5, "2.0", " 2", None, [2]])
@pytest.mark.parametrize("where", ["protocolVersion", "prerequisites"])
def test_protocol_version_other_than_the_integer_2_is_refused(value, where):
    if where == "protocolVersion":
        data, field = job(protocolVersion=value), "protocolVersion"
    else:
        data = job(prerequisites=[{"protocolVersion": value, "name": "img", "type": "dockerimage", "uri": "b"}])
        field = "prerequisites[0].protocolVersion"
        if value is None:
            return  # optional there: null is "not given"
    error = rejection(as_json(data))
    assert error.field == field and "integer 2" in error.message, (error.field, error.message)


@pytest.mark.parametrize("value", [2, "2"])
def test_protocol_version_2_and_the_schema_string_are_accepted(value):
    # openpai-protocol-schema-v2.yaml: oneOf {number enum [2]}, {string enum ["2"]}
    assert parse_job(as_json(job(protocolVersion=value))).protocol_version == 2


def test_yaml_float_protocol_version_is_refused_and_a_stored_one_reloads():
    text = yaml.safe_dump(job(protocolVersion=2.0))
    assert "protocolVersion: 2.0" in text
    assert rejection(text).field == "protocolVersion"
    assert parse_job(text, stored=True).protocol_version == 2


# --------------------------------------------------------------------------- rendered size


def amplifier(param_bytes: int, refs: int, **changes: Any) -> str:
    """The reported body: one ``param_bytes`` parameter referenced ``refs`` times in one command."""
    command = "echo " + " ".join(["<% $parameters.big %>"] * refs)
    return as_json(job(parameters={"big": "x" * param_bytes}, **{"taskRoles.train.commands": [command]}, **changes))


def test_a_30_kb_body_rendering_to_10_mb_is_refused_naming_the_role_and_size():
    text = amplifier(10_000, 1_000)
    assert len(text) < 40_000
    error = rejection(text)
    assert error.field == "taskRoles.train.commands"
    assert "'train'" in error.message and str(len("echo ") + 10_000 * 1_000 + 999 + 1) in error.message
    assert str(MAX_RENDERED_BYTES) in error.message


def test_the_bound_is_counted_without_rendering():
    """A body that would render to 200 MB is refused without ever holding the rendered text."""
    text = amplifier(200_000, 1_000)
    tracemalloc.start()
    try:
        with pytest.raises(ValidationError):
            parse_job(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, peak


def test_commands_at_the_bound_are_accepted_and_one_byte_more_is_not():
    # "echo " + refs * 1000 + " " separators + newline = the rendered size
    overhead = len("echo ") + 1
    refs = 100
    param = (MAX_RENDERED_BYTES - overhead - (refs - 1)) // refs
    spare = MAX_RENDERED_BYTES - overhead - (refs - 1) - param * refs
    command = "echo " + "x" * spare + " ".join(["<% $parameters.big %>"] * refs)
    data = job(parameters={"big": "y" * param}, **{"taskRoles.train.commands": [command]})
    spec = parse_job(as_json(data))
    assert spec.rendered_commands_size("train") == MAX_RENDERED_BYTES
    assert sum(len(line.encode()) + 1 for line in spec.render_commands("train")) == MAX_RENDERED_BYTES
    data["taskRoles"]["train"]["commands"] = [command + "z"]
    assert rejection(as_json(data)).field == "taskRoles.train.commands"


def test_deployment_commands_count_and_bytes_are_utf8():
    pre = ["<% $parameters.big %>"] * 300
    data = job(parameters={"big": "é" * 2_000},  # 4,000 bytes in UTF-8
               deployments=[{"name": "d", "taskRoles": {"train": {"preCommands": pre}}}])
    error = rejection(as_json(data))
    assert error.field == "taskRoles.train.commands" and str(300 * 4_001 + len("echo hi") + 1) in error.message


def test_secret_references_count_and_registry_credentials_are_bounded():
    data = job(secrets={"pw": "s" * 5_000},
               prerequisites=[{"name": "img", "type": "dockerimage", "uri": "busybox",
                               "auth": {"password": "<% $secrets.pw %>" * 300}}])
    error = rejection(as_json(data))
    assert error.field == "prerequisites[0].auth.password" and "1500000" in error.message
    assert "sss" not in error.message  # the secret itself is not echoed


# --------------------------------------------------------------------------- JSON read as JSON


def test_json_with_an_escaped_surrogate_pair_is_accepted():
    text = as_json(job(description="launch 😀 — ok"))
    assert "\\ud83d\\ude00" in text
    assert parse_job(text).description == "launch 😀 — ok"
    assert parse_job(text.encode()).description == "launch 😀 — ok"


def test_json_escaped_slash_and_bom():
    text = "\ufeff  " + as_json(job(description="a/b")).replace("a/b", "a\\/b")
    assert parse_job(text).description == "a/b"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        pytest.param('{"a": "\\ud800"}', "lone surrogate", id="lone-surrogate"),
        pytest.param('{"a": {"b": ["ok", "\\udc80"]}}', "at a.b[1]", id="lone-surrogate-path"),
        pytest.param('{"\\ud800": 1}', "lone surrogate", id="lone-surrogate-key"),
        pytest.param("[" * 100_000 + "]" * 100_000, "nesting deeper than 64", id="nesting-100000"),
        pytest.param("[" * 65 + "]" * 65, "nesting deeper than 64", id="nesting-65"),
        pytest.param('{"a": 1, "a": 2}', "duplicate key 'a'", id="duplicate-key"),
        pytest.param("[" + ",".join(["0"] * 100_001) + "]", "more than 100000 nodes", id="nodes"),
    ],
)
def test_json_keeps_the_yaml_limits(text, reason):
    with pytest.raises(ValidationError) as info:
        safeyaml.load(text, field="body")
    assert info.value.field == "body" and reason in info.value.message, info.value.message


def test_json_at_the_limits_is_read():
    assert safeyaml.load("[" * 64 + "]" * 64) is not None
    assert safeyaml.load('["[[[[[[[[", {"k": "]]]]"}]') == ["[[[[[[[[", {"k": "]]]]"}]


def test_yaml_flow_text_that_is_not_json_is_still_yaml():
    assert safeyaml.load("{a: 1, b: [x, y]}") == {"a": 1, "b": ["x", "y"]}
    assert safeyaml.load("[NaN, 1]") == ["NaN", 1]
    assert safeyaml.load('{"a": NaN}') == {"a": "NaN"}  # as YAML reads it, not float('nan')


def test_a_lone_surrogate_in_a_job_names_the_field():
    error = rejection('{"protocolVersion": 2, "name": "x", "description": "\\ud800"}')
    assert error.field == "body" and "description" in error.message


# --------------------------------------------------------------------------- runtime plugins


@pytest.mark.parametrize("plugin", ["mlflow_tracker", "git"])
def test_unimplemented_runtime_plugin_is_refused_naming_it(plugin):
    data = job(extras={RUNTIME_PLUGIN_KEY: [{"plugin": plugin, "parameters": {}}]})
    error = rejection(as_json(data))
    assert error.field == f"{PLUGINS}[0].plugin" and repr(plugin) in error.message


@pytest.mark.parametrize("value", [{"plugin": "ssh"}, "ssh", [{"parameters": {}}], ["ssh"]])
def test_malformed_runtime_plugin_list_is_refused(value):
    assert rejection(as_json(job(extras={RUNTIME_PLUGIN_KEY: value}))).field.startswith(PLUGINS)


def test_no_runtime_plugins_is_fine():
    assert parse_job(as_json(job(extras={RUNTIME_PLUGIN_KEY: [], "submitFrom": "x"}))).gang


def test_a_stored_job_with_a_plugin_still_reloads():
    data = job(extras={RUNTIME_PLUGIN_KEY: [{"plugin": "mlflow_tracker"}]})
    assert parse_job(as_json(data), stored=True).name == "admission"


def test_the_json_depth_scan_is_linear_on_an_unterminated_string() -> None:
    """A body that opens a string and never closes it, with an escaped quote every two characters:
    a scanner that retried from every quote took 4.3 s on 20,000 of them (quadratic: ~45 min for a
    1 MiB body). Judged as a ratio to a benign text of the same length, measured in this run."""
    import time

    from apiary.spec.safeyaml import json_depth

    n = 20_000
    hostile = '{"a": "' + '\\"' * n
    benign = '{"a": "' + "xy" * n + '"}'

    def cost(text: str) -> float:
        t0 = time.perf_counter()
        for _ in range(5):
            json_depth(text, 64)
        return time.perf_counter() - t0

    cost(benign)  # warm up
    assert json_depth(hostile, 64) == 1 and json_depth(benign, 64) == 1
    assert cost(hostile) < 20 * cost(benign) + 0.05
