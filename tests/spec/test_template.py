"""Job templates, the pure model (apiary.spec.template): parameters derived from the job's
``parameters:``, refined by ``parameterSchema``; values typed, bounded and overlaid by ``render``;
model parameters resolved through the resolver given, or refused without one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from apiary.errors import NotFoundError, ValidationError
from apiary.spec.job import parse_job
from apiary.spec.template import Template, coerce_value, parse_template, render, split_assignments

SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "marketplace" / "templates"


def job_yaml(parameters: dict[str, Any] | None = None, command: str = "echo <% $parameters.epochs %>") -> str:
    doc: dict[str, Any] = {
        "protocolVersion": 2, "name": "train", "type": "job",
        "prerequisites": [{"protocolVersion": 2, "name": "img", "type": "dockerimage", "uri": "python:3.11"}],
        "taskRoles": {"train": {"instances": 1, "dockerImage": "img",
                                "resourcePerInstance": {"cpu": 1, "memoryMB": 512, "gpu": 0},
                                "commands": [command]}},
        "defaults": {"virtualCluster": "default"},
    }
    if parameters is not None:
        doc["parameters"] = parameters
    return yaml.safe_dump(doc, sort_keys=False)


def template(parameters: dict[str, Any] | None = None, schema: dict[str, Any] | None = None,
             command: str = "echo <% $parameters.epochs %>", **extra: Any) -> Template:
    doc = {"name": "t", "summary": "s", "job": job_yaml(parameters, command), **extra}
    if schema is not None:
        doc["parameterSchema"] = schema
    return parse_template(doc)


DEFAULTS = {"epochs": 3, "lr": 0.1, "amp": True, "model_name": "mlp"}


@pytest.mark.parametrize(("name", "default", "kind"), [
    ("epochs", 3, "integer"), ("lr", 0.1, "number"), ("amp", True, "boolean"), ("model_name", "mlp", "string"),
], ids=["int", "float", "bool", "str"])
def test_each_parameter_takes_its_type_and_default_from_the_jobs_parameters(name: str, default: Any,
                                                                           kind: str) -> None:
    p = template(DEFAULTS).parameter(name)
    assert p is not None and (p.type, p.default) == (kind, default)


def test_parameters_keep_the_jobs_order_and_their_refinements() -> None:
    t = template(DEFAULTS, {"epochs": {"title": "Epochs", "minimum": 1, "maximum": 50},
                            "model_name": {"enum": ["mlp", "cnn"]}})
    assert [p.name for p in t.parameters] == list(DEFAULTS)
    schema = t.run_form_schema()["properties"]
    assert schema["epochs"] == {"type": "integer", "title": "Epochs", "default": 3, "minimum": 1, "maximum": 50}
    assert schema["model_name"]["enum"] == ["mlp", "cnn"]
    assert schema["amp"] == {"type": "boolean", "title": "amp", "default": True}


@pytest.mark.parametrize(("values", "want"), [
    ({}, DEFAULTS),
    ({"epochs": 7}, {**DEFAULTS, "epochs": 7}),
    ({"epochs": "7"}, {**DEFAULTS, "epochs": 7}),
    ({"lr": "0.5", "amp": "false"}, {**DEFAULTS, "lr": 0.5, "amp": False}),
    ({"lr": 2}, {**DEFAULTS, "lr": 2}),
    ({"model_name": "cnn"}, {**DEFAULTS, "model_name": "cnn"}),
], ids=["defaults", "int", "int-text", "float-and-bool-text", "int-for-number", "string"])
def test_render_overlays_typed_values_on_the_defaults(values: dict[str, Any], want: dict[str, Any]) -> None:
    out = render(template(DEFAULTS), values, suffix="abc123")
    doc = yaml.safe_load(out)
    assert doc["parameters"] == want
    assert doc["name"] == "train-abc123"
    spec = parse_job(out)  # what is submitted is a job, and its commands render with the values
    assert spec.render_commands("train") == [f"echo {want['epochs']}"]


@pytest.mark.parametrize(("values", "field", "words"), [
    ({"epoch": 1}, "parameters.epoch", "no parameter 'epoch'"),
    ({"epochs": "three"}, "parameters.epochs", "not an integer"),
    ({"epochs": 1.5}, "parameters.epochs", "not an integer"),
    ({"epochs": True}, "parameters.epochs", "not an integer"),
    ({"lr": "fast"}, "parameters.lr", "not a number"),
    ({"lr": "nan"}, "parameters.lr", "not a number"),
    ({"amp": "maybe"}, "parameters.amp", "not a boolean"),
    ({"model_name": 3}, "parameters.model_name", "not a string"),
    ({"epochs": 0}, "parameters.epochs", "less than the minimum 1"),
    ({"epochs": 51}, "parameters.epochs", "more than the maximum 50"),
    ({"model_name": "rnn"}, "parameters.model_name", "not one of"),
], ids=["unknown", "int-text", "int-float", "int-bool", "number-text", "nan", "bool-text", "str-int", "below-min",
        "above-max", "not-in-enum"])
def test_bad_values_are_refused_naming_the_parameter(values: dict[str, Any], field: str, words: str) -> None:
    t = template(DEFAULTS, {"epochs": {"minimum": 1, "maximum": 50}, "model_name": {"enum": ["mlp", "cnn"]}})
    with pytest.raises(ValidationError) as e:
        render(t, values, suffix="x")
    assert e.value.field == field and words in e.value.message


def test_unknown_parameter_message_lists_the_known_ones() -> None:
    with pytest.raises(ValidationError, match=r"parameters: epochs, lr, amp, model_name"):
        render(template(DEFAULTS), {"nope": 1}, suffix="x")


def test_job_name_given_or_derived_and_virtual_cluster_overridden() -> None:
    t = template(DEFAULTS)
    assert yaml.safe_load(render(t, {}, suffix="s", job_name="mine"))["name"] == "mine"
    doc = yaml.safe_load(render(t, {}, suffix="s", virtual_cluster="vc1"))
    assert doc["defaults"]["virtualCluster"] == "vc1"
    with pytest.raises(ValidationError) as e:
        render(t, {}, suffix="s", job_name="bad name")
    assert e.value.field == "name"


MODEL = {"checkpoint": "mnist/1", "epochs": 1}
MODEL_SCHEMA = {"checkpoint": {"type": "model", "title": "Checkpoint"}}


@pytest.mark.parametrize(("values", "resolver", "want_uri", "error"), [
    ({}, {"mnist/1": "models:/mnist/1"}, "models:/mnist/1", None),
    ({"checkpoint": "mnist/2"}, {"mnist/2": "s3://bucket/mnist/2"}, "s3://bucket/mnist/2", None),
    ({}, None, None, "no model registry"),
    ({"checkpoint": "mnist"}, {}, None, "NAME/VERSION"),
    ({"checkpoint": "ghost/9"}, {}, None, "NotFound"),
], ids=["default-resolved", "given-resolved", "no-resolver", "not-a-reference", "unknown-version"])
def test_model_parameters_resolve_through_the_resolver(values: dict[str, Any], resolver: dict[str, str] | None,
                                                       want_uri: str | None, error: str | None) -> None:
    t = template(MODEL, MODEL_SCHEMA, command="echo <% $parameters.checkpoint %>")
    assert t.parameter("checkpoint").type == "model"  # type: ignore[union-attr]
    asked: list[str] = []

    def resolve(ref: str) -> str:
        asked.append(ref)
        if resolver is None or ref not in resolver:
            raise NotFoundError(f"Model version {ref} not found.")
        return resolver[ref]

    if error is None:
        out = render(t, values, suffix="x", resolve=resolve)
        assert parse_job(out).render_commands("train") == [f"echo {want_uri}"]
        assert asked == [values.get("checkpoint", "mnist/1")]
    elif error == "NotFound":
        with pytest.raises(NotFoundError):
            render(t, values, suffix="x", resolve=resolve)
    else:
        with pytest.raises(ValidationError, match=error) as e:
            render(t, values, suffix="x", resolve=resolve if resolver is not None else None)
        assert e.value.field == "parameters.checkpoint"
        assert asked == []


def test_the_model_form_field_is_a_string_with_the_reference_pattern() -> None:
    prop = template(MODEL, MODEL_SCHEMA).run_form_schema()["properties"]["checkpoint"]
    assert prop["type"] == "string" and prop["default"] == "mnist/1" and "pattern" in prop


@pytest.mark.parametrize(("doc", "field"), [
    ({"name": "bad name"}, "name"),
    ({"job": ""}, "job"),
    ({"job": "just text"}, "job"),
    ({"job": job_yaml({"e": 1}).replace("protocolVersion: 2", "protocolVersion: 3")}, "job.protocolVersion"),
    ({"job": job_yaml({"e": [1, 2]})}, "job.parameters.e"),
    ({"job": job_yaml({"e": None})}, "job.parameters.e"),
    ({"parameterSchema": {"nope": {"title": "x"}}}, "parameterSchema.nope"),
    ({"parameterSchema": {"epochs": {"type": "boolean"}}}, "parameterSchema.epochs.type"),
    ({"parameterSchema": {"epochs": {"minimum": "a"}}}, "parameterSchema.epochs.minimum"),
    ({"parameterSchema": {"epochs": {"minimum": 5, "maximum": 1}}}, "parameterSchema.epochs.minimum"),
    ({"parameterSchema": {"epochs": {"minimum": 10}}}, "job.parameters.epochs"),
    ({"parameterSchema": {"epochs": {"colour": "red"}}}, "parameterSchema.epochs.colour"),
    ({"parameterSchema": {"epochs": {"enum": ["x"]}}}, "parameterSchema.epochs.enum[0]"),
    ({"tags": ["ok", "not ok"]}, "tags[1]"),
    ({"visibility": {"groups": ["a"], "users": ["b"]}}, "visibility.users"),
    ({"visibility": {"virtualClusters": "vc1"}}, "visibility.virtualClusters"),
    ({"summary": 3}, "summary"),
    ({"extra": 1}, "extra"),
    ({"official": "yes"}, "official"),
], ids=["name", "no-job", "job-not-a-mapping", "job-invalid", "list-parameter", "null-parameter",
        "schema-for-unknown", "type-mismatch", "minimum-not-number", "min-over-max", "default-below-min",
        "schema-unknown-key", "enum-wrong-type", "tag", "visibility-key", "visibility-not-list", "summary-type",
        "unknown-key", "official-type"])
def test_publishing_a_bad_template_names_the_field(doc: dict[str, Any], field: str) -> None:
    base = {"name": "t", "job": job_yaml({"epochs": 3})}
    with pytest.raises(ValidationError) as e:
        parse_template({**base, **doc})
    assert e.value.field == field, e.value.message


def test_visibility_admits_groups_or_vcs_and_empty_is_everyone() -> None:
    everyone = template(DEFAULTS).visibility
    limited = template(DEFAULTS, visibility={"groups": ["team-a"], "virtualClusters": ["vc9"]}).visibility
    assert everyone.everyone and everyone.admits(frozenset(), frozenset())
    assert limited.admits(frozenset({"team-a"}), frozenset())
    assert limited.admits(frozenset(), frozenset({"vc9"}))
    assert not limited.admits(frozenset({"team-b"}), frozenset({"default"}))


def test_coerce_and_assignments() -> None:
    p = template(DEFAULTS).parameter("amp")
    assert p is not None and coerce_value(p, "yes", "f") is True
    assert split_assignments(["epochs=3", "cmd=a=b"]) == {"epochs": "3", "cmd": "a=b"}
    with pytest.raises(ValidationError, match="NAME=VALUE"):
        split_assignments(["epochs"])
    with pytest.raises(ValidationError, match="given twice"):
        split_assignments(["a=1", "a=2"])


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*.yaml")), ids=lambda p: p.stem)
def test_each_shipped_template_parses_and_renders_a_valid_job(path: Path) -> None:
    t = parse_template(path.read_text())
    assert t.name == path.stem and t.summary and t.description and t.tags
    out = render(t, {}, suffix="x", resolve=lambda ref: f"models:/{ref}")
    spec = parse_job(out)
    for role in spec.task_roles:
        assert all("<%" not in c for c in spec.render_commands(role))


def test_mnist_template_passes_its_parameters_to_the_script() -> None:
    t = parse_template((SHIPPED / "mnist.yaml").read_text())
    out = parse_job(render(t, {"epochs": "2", "lr": "0.05", "batch_size": 32}, suffix="x"))
    [command] = out.render_commands("train")
    assert "--epochs 2 " in command and "--lr 0.05 " in command and "--batch-size 32 " in command


def test_a_model_parameter_the_registry_refuses_is_named_in_the_error() -> None:
    t = parse_template((SHIPPED / "mnist-finetune.yaml").read_text())

    def refuse(ref: str) -> str:
        raise NotFoundError(f"no model {ref}")

    with pytest.raises(NotFoundError, match=r"^parameters\.base_model: no model mnist/7$"):
        render(t, {"base_model": "mnist/7"}, suffix="x", resolve=refuse)
    [command] = parse_job(render(t, {"base_model": "mnist/7"}, suffix="x",
                                 resolve=lambda ref: f"models:/{ref}")).render_commands("train")
    assert '--init-model "models:/mnist/7"' in command or "--init-model models:/mnist/7" in command
