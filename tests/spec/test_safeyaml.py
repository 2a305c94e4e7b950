"""Bounded YAML (apiary.spec.safeyaml): depth, alias and size limits, duplicate keys, encoding,
and plain documents loading exactly as ``yaml.safe_load`` loads them.

Every test runs against both loaders: PyYAML's pure-Python parser and libyaml's (where PyYAML has
it), since the checks must not depend on which one parses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.builders import LAB6, REPO

from apiary.errors import ValidationError
from apiary.spec import safeyaml
from apiary.spec.cluster import load_cluster_config
from apiary.spec.job import parse_job

_LOADERS = [pytest.param(safeyaml._PyLoader, id="python")]
if hasattr(safeyaml, "_CLoader"):
    _LOADERS.append(pytest.param(safeyaml._CLoader, id="libyaml"))


@pytest.fixture(autouse=True, params=_LOADERS)
def loader(request, monkeypatch):
    """Runs the test with :func:`safeyaml.load` on one loader."""
    monkeypatch.setattr(safeyaml, "_Loader", request.param)
    return request.param


# A minimal valid job (test_job's MINIMAL), as text to append YAML to.
JOB = """\
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


def rejected(text: str | bytes, **options) -> ValidationError:
    """The ValidationError ``safeyaml.load(text, **options)`` raises (fails the test if it loads)."""
    with pytest.raises(ValidationError) as info:
        safeyaml.load(text, **options)
    return info.value


# --------------------------------------------------------------------------- nesting

DEEP = [
    pytest.param("[" * 5_000 + "]" * 5_000, id="flow-seq-5000"),
    pytest.param("[" * 1_000_000 + "]" * 1_000_000, id="flow-seq-1000000"),
    pytest.param("{a: " * 5_000 + "1" + "}" * 5_000, id="flow-map-5000"),
    pytest.param("{a: " * 1_000_000 + "1" + "}" * 1_000_000, id="flow-map-1000000"),
    pytest.param("- " * 5_000 + "x", id="block-seq-5000"),
    pytest.param("- " * 1_000_000 + "x", id="block-seq-1000000"),
    pytest.param("".join(" " * i + "a:\n" for i in range(5_000)) + " " * 5_000 + "1\n", id="block-map-5000"),
    pytest.param("[" * 1_000_000, id="flow-unclosed-1000000"),
]


@pytest.mark.parametrize("text", DEEP)
def test_deep_nesting_is_refused_without_recursion_error(text):
    err = rejected(text)
    assert err.field == "body"
    assert "YAML nesting deeper than 64 levels" in err.reason
    assert "line" in err.reason


@pytest.mark.parametrize(
    ("depth", "max_depth", "ok"),
    [
        pytest.param(64, 64, True, id="at-default-limit"),
        pytest.param(65, 64, False, id="one-over-default"),
        pytest.param(3, 3, True, id="at-custom-limit"),
        pytest.param(4, 3, False, id="one-over-custom"),
    ],
)
@pytest.mark.parametrize("style", ["flow", "block"])
def test_depth_limit_is_exact(depth, max_depth, ok, style):
    if style == "flow":
        text = "[" * depth + "x" + "]" * depth
    else:
        text = "- " * depth + "x"
    expected = "x"
    for _ in range(depth):
        expected = [expected]
    if ok:
        assert safeyaml.load(text, max_depth=max_depth) == expected
    else:
        assert f"deeper than {max_depth} levels" in rejected(text, max_depth=max_depth).reason


def test_alias_counts_as_the_depth_of_what_it_names():
    # 40 + 30 levels: each half fits in 64, the expanded data does not.
    text = "a: &a " + "[" * 40 + "]" * 40 + "\nb: " + "[" * 30 + "*a" + "]" * 30 + "\n"
    assert "deeper than 64 levels at line 2" in rejected(text).reason
    assert safeyaml.load(text, max_depth=71) == yaml.safe_load(text)


# --------------------------------------------------------------------------- aliases and size

# The classic "billion laughs" in YAML: nine levels of nine aliases, 9**9 strings once expanded.
LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_alias_bomb_is_refused_before_expansion():
    assert len(LAUGHS) < 600
    err = rejected(LAUGHS)
    assert err.field == "body"
    assert "YAML aliases expand to more than 100000 nodes" in err.reason


def test_alias_bomb_in_job_extras_is_refused():
    job = JOB + "extras:\n  bomb:\n" + "".join(f"    {line}\n" for line in LAUGHS.splitlines())
    with pytest.raises(ValidationError) as info:
        parse_job(job)
    assert info.value.field == "body"
    assert "more than 100000 nodes" in info.value.reason


@pytest.mark.parametrize(
    ("aliases", "ok"), [pytest.param(100, True, id="100-aliases"), pytest.param(101, False, id="101-aliases")]
)
def test_alias_count_limit(aliases, ok):
    text = "a: &x 1\nb: [" + ", ".join(["*x"] * aliases) + "]\n"
    if ok:
        assert safeyaml.load(text) == {"a": 1, "b": [1] * aliases}
    else:
        assert "more than 100 YAML aliases" in rejected(text).reason


@pytest.mark.parametrize(
    ("text", "nodes"),
    [
        pytest.param("[1, 2, 3]", 4, id="flat-sequence"),
        pytest.param("{a: 1, b: [2]}", 6, id="keys-count"),
        # root 1 + key a 1 + [1, 2] 3 + key b 1 + *x as big as its target 3
        pytest.param("a: &x [1, 2]\nb: *x\n", 9, id="alias-counts-its-target"),
        pytest.param("a: &x [1, 2]\nb: &y [*x, *x]\nc: *y\n", 1 + 4 + 1 + 7 + 1 + 7, id="nested-aliases"),
    ],
)
def test_node_limit_counts_expanded_nodes_exactly(text, nodes):
    assert safeyaml.load(text, max_nodes=nodes) == yaml.safe_load(text)
    reason = rejected(text, max_nodes=nodes - 1).reason
    assert f"more than {nodes - 1} nodes" in reason


def test_large_document_without_aliases_is_refused_by_size():
    # The default (100,000) behaves the same; a small limit keeps the pure-Python run short.
    assert "YAML document has more than 1000 nodes" in rejected("[" + "1," * 1_000 + "]", max_nodes=1_000).reason


def test_recursive_alias_is_refused():
    assert "refers to a node that contains it" in rejected("a: &a [1, *a]\n").reason


# --------------------------------------------------------------------------- duplicate keys

DUPLICATES = [
    pytest.param("protocolVersion: 2\nname: a\nname: b\n", "'name' at line 3 (first at line 2)", id="top-level"),
    pytest.param("taskRoles:\n  train:\n    instances: 1\n    instances: 2\n", "'instances' at line 4", id="nested"),
    pytest.param("a: {x: 1, y: 2, x: 3}\n", "'x' at line 1", id="flow-mapping"),
    pytest.param("- {a: 1}\n- b: 1\n  b: 2\n", "'b' at line 3", id="in-a-list"),
    pytest.param("name: a\n'name': b\n", "'name' at line 2", id="quoted-and-plain"),
    pytest.param("1: a\n0x1: b\n", "1 at line 2", id="equal-ints"),
    pytest.param("true: a\nyes: b\n", "True at line 2", id="equal-bools"),
    pytest.param("a: &k name\n*k : 1\nname: 2\n", "'name' at line 3", id="alias-key"),
]


@pytest.mark.parametrize(("text", "where"), DUPLICATES)
def test_duplicate_keys_are_refused_naming_key_and_line(text, where):
    err = rejected(text)
    assert err.field == "body"
    assert f"duplicate key {where}" in err.reason


def test_duplicate_key_in_job_spec_names_it():
    with pytest.raises(ValidationError, match=r"duplicate key 'name' at line 3 \(first at line 2\)"):
        parse_job(JOB.replace("name: minimal\n", "name: minimal\nname: other\n"))


# --------------------------------------------------------------------------- merge keys

MERGES = [
    pytest.param("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  y: 3\n", {"base": {"x": 1, "y": 2}, "d": {"x": 1, "y": 3}},
                 id="own-key-overrides-merged"),
    pytest.param("a: &a {x: 1}\nb: &b {y: 2}\nc: {<<: [*a, *b], z: 3}\n",
                 {"a": {"x": 1}, "b": {"y": 2}, "c": {"x": 1, "y": 2, "z": 3}}, id="list-of-merges"),
    pytest.param("a: &a {x: 1}\nb: &b {<<: *a, x: 2}\nc: {<<: *b, y: 3}\n",
                 {"a": {"x": 1}, "b": {"x": 2}, "c": {"x": 2, "y": 3}}, id="merge-of-merge"),
]


@pytest.mark.parametrize(("text", "expected"), MERGES)
def test_merge_keys_still_work(text, expected):
    assert safeyaml.load(text) == expected == yaml.safe_load(text)


# --------------------------------------------------------------------------- encoding and bad text

BAD_TEXT = [
    pytest.param("a: é\n".encode("latin-1"), "not UTF-8 text", id="latin-1"),
    pytest.param("a: 1\n".encode("utf-16"), "not UTF-8 text", id="utf-16-with-bom"),
    pytest.param(b"a: \xff\xfe\n", "not UTF-8 text", id="invalid-bytes"),
    pytest.param("a: \x01\n", "not valid YAML", id="control-character"),
    pytest.param("a: \ud800\n", "not valid", id="lone-surrogate"),
    pytest.param("a: [unclosed\n", "not valid YAML at line 2, column 1", id="broken"),
    pytest.param("a: 1\n---\nb: 2\n", "not valid YAML at line 2", id="two-documents"),
    pytest.param("a: *nowhere\n", "undefined alias", id="undefined-alias"),
    pytest.param("a: !!python/object:os.system x\n", "not valid YAML", id="python-tag"),
    pytest.param("a: !!int foo\n", "no valid !!int", id="bad-int"),
    pytest.param("a: " + "1" * 5_000 + "\n", "no valid !!int", id="int-over-4300-digits"),
    pytest.param("a: 2001-13-45\n", "no valid !!timestamp", id="impossible-date"),
    pytest.param("a: !!bool maybe\n", "no valid !!bool", id="bad-bool"),
    pytest.param("? [a]\n: 1\n", "unhashable key", id="list-as-key"),
]


@pytest.mark.parametrize(("text", "reason"), BAD_TEXT)
def test_bad_text_is_a_validation_error(text, reason):
    err = rejected(text, field="spec", what="thing")
    assert err.field == "spec"
    assert reason in err.reason


def test_utf8_bom_and_empty_documents_load():
    assert safeyaml.load("\ufeffa: 1\n".encode()) == {"a": 1}
    assert safeyaml.load("") is None
    assert safeyaml.load(b"# only a comment\n") is None


# --------------------------------------------------------------------------- same data as yaml.safe_load

EXAMPLES = sorted([*LAB6.glob("*.yaml"), *(REPO / "examples").glob("*/*.yaml"),
                   *(REPO / "tests" / "scheduler" / "hived_design").glob("*.yaml")])


@pytest.mark.parametrize("path", sorted(set(EXAMPLES)), ids=lambda p: str(Path(p).relative_to(REPO)))
def test_repository_yaml_loads_as_safe_load_does(path):
    text = path.read_text(encoding="utf-8")
    assert safeyaml.load(text) == yaml.safe_load(text)
    assert safeyaml.load(path.read_bytes()) == yaml.safe_load(text)


JSON_LIKE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=JSON_LIKE)
def test_dumped_json_like_data_loads_back_unchanged(data):
    text = yaml.safe_dump(data)
    assert safeyaml.load(text) == data == yaml.safe_load(text)
    assert safeyaml.load(text.encode("utf-8")) == data


# --------------------------------------------------------------------------- callers


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        pytest.param(JOB + "extras: " + "[" * 5_000 + "]" * 5_000 + "\n", "nesting deeper than 64", id="deep-extras"),
        pytest.param(JOB.encode() + b"description: \xff\n", "job spec is not UTF-8 text", id="not-utf8"),
        pytest.param(JOB + "description: [\n", "job spec is not valid YAML at line", id="broken"),
    ],
)
def test_parse_job_reads_through_safeyaml(text, reason):
    with pytest.raises(ValidationError) as info:
        parse_job(text)
    assert info.value.field == "body"
    assert reason in info.value.reason


WRAPPED = (LAB6 / "hived-config-one-vc.yaml").read_text(encoding="utf-8")  # hivedscheduler: {config: "..."}
BARE = yaml.safe_load(WRAPPED)["hivedscheduler"]["config"]


@pytest.mark.parametrize(
    ("text", "field", "reason"),
    [
        pytest.param(BARE + "virtualClusters: {}\n", "config", "duplicate key 'virtualClusters'", id="duplicate-key"),
        pytest.param(WRAPPED + "hivedscheduler: {}\n", "config", "duplicate key 'hivedscheduler'",
                     id="duplicate-key-in-wrapper"),
        pytest.param(LAUGHS, "config", "more than 1000000 nodes", id="alias-bomb"),
        pytest.param(BARE.encode() + b"# \xff\n", "config", "not UTF-8 text", id="not-utf8"),
        pytest.param(
            yaml.safe_dump({"hivedscheduler": {"config": BARE + "virtualClusters: {}\n"}}),
            "hivedscheduler.config",
            "duplicate key 'virtualClusters'",
            id="duplicate-key-in-wrapped-config",
        ),
        pytest.param(
            yaml.safe_dump({"hivedscheduler": {"config": "[" * 5_000}}),
            "hivedscheduler.config",
            "nesting deeper than 64",
            id="deep-wrapped-config",
        ),
    ],
)
def test_cluster_config_reads_through_safeyaml(text, field, reason):
    assert load_cluster_config(BARE) == load_cluster_config(WRAPPED)  # both forms load when valid
    with pytest.raises(ValidationError) as info:
        load_cluster_config(text)
    assert info.value.field == field
    assert reason in info.value.reason
