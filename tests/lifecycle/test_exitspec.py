"""OpenPAI's job exit spec as package data, its classification and the codes Apiary issues."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import pytest

import apiary.lifecycle.exitspec as exitspec_module
from apiary.lifecycle import (
    EXIT_ATTEMPT_COMPLETED,
    EXIT_LAUNCH_FAILED,
    EXIT_LIVENESS_FAILED,
    EXIT_NODE_LOST,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_SUCCEEDED,
    UNDEFINED_NEGATIVE_EXIT,
    UNDEFINED_POSITIVE_EXIT,
    ExitInfo,
    classify_exit,
    exit_spec,
)

# shared/ sits beside the checkout (as in CI).
REFERENCE = Path(__file__).resolve().parents[3] / "shared/reference/openpai/k8s-job-exit-spec.yaml"

BEHAVIORS = {"TRANSIENT", "TRANSIENT_CONFLICT", "PERMANENT", "UNKNOWN"}
REACTIONS = {"ALWAYS_RETRY", "ALWAYS_BACKOFF_RETRY", "RETRY_TO_MAX", "NEVER_RETRY"}
TYPES = {
    "USER_SUCCESS",
    "USER_STOP",
    "USER_FAILURE",
    "PLATFORM_FAILURE",
    "RESOURCE_ALLOCATION_TIMEOUT",
    "UNKNOWN_FAILURE",
}


def test_spec_is_package_data_with_mit_header():
    text = resources.files("apiary.lifecycle").joinpath("k8s-job-exit-spec.yaml").read_text("utf-8")
    assert text.startswith("# Copyright (c) Microsoft Corporation")
    assert "MIT License" in text[:200]


@pytest.mark.skipif(not REFERENCE.exists(), reason="reference copy not present")
def test_spec_is_a_verbatim_copy_of_the_reference():
    packaged = resources.files("apiary.lifecycle").joinpath("k8s-job-exit-spec.yaml").read_bytes()
    assert packaged == REFERENCE.read_bytes()


def test_spec_is_parsed_once_and_read_only():
    assert exit_spec() is exit_spec()
    with pytest.raises(TypeError):
        exit_spec()[12345] = exit_spec()[0]  # type: ignore[index]


def test_every_entry_is_well_formed():
    spec = exit_spec()
    assert len(spec) >= 60
    phrases = [info.phrase for info in spec.values()]
    assert len(set(phrases)) == len(phrases)  # the schema says phrase is unique
    for code, info in spec.items():
        assert isinstance(info, ExitInfo)
        assert info.code == code
        assert -8000 <= code <= 256  # the schema's code range
        assert info.behavior in BEHAVIORS, code
        assert info.reaction in REACTIONS, code
        assert info.type in TYPES, code


def test_exit_info_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        exit_spec()[0].code = 1  # type: ignore[misc]


CLASSIFY_CASES = [
    # (code, phrase, type, behavior, reaction)
    (0, "Succeeded", "USER_SUCCESS", "UNKNOWN", "NEVER_RETRY"),
    (1, "PAIRuntimeExitAbnormally", "PLATFORM_FAILURE", "UNKNOWN", "RETRY_TO_MAX"),
    (137, "ContainerSigKillReceived", "PLATFORM_FAILURE", "TRANSIENT", "ALWAYS_RETRY"),
    (143, "ContainerSigTermReceived", "PLATFORM_FAILURE", "TRANSIENT", "ALWAYS_RETRY"),
    (-1001, "PodNodeLost", "PLATFORM_FAILURE", "TRANSIENT", "ALWAYS_RETRY"),
    (141, "ContainerSigPipeReceived", "USER_FAILURE", "PERMANENT", "NEVER_RETRY"),
    (
        251,
        "JobGangAllocationTimeout",
        "RESOURCE_ALLOCATION_TIMEOUT",
        "TRANSIENT_CONFLICT",
        "ALWAYS_BACKOFF_RETRY",
    ),
    (255, "PAIRuntimeUnknownFailed", "UNKNOWN_FAILURE", "UNKNOWN", "RETRY_TO_MAX"),
    (77, "PAIRuntimeExitAbnormally", "PLATFORM_FAILURE", "UNKNOWN", "RETRY_TO_MAX"),
    (4242, "PAIRuntimeExitAbnormally", "PLATFORM_FAILURE", "UNKNOWN", "RETRY_TO_MAX"),
    (-5, "ContainerUndefinedNegativeExitCode", "UNKNOWN_FAILURE", "UNKNOWN", "RETRY_TO_MAX"),
    (-9999, "ContainerUndefinedNegativeExitCode", "UNKNOWN_FAILURE", "UNKNOWN", "RETRY_TO_MAX"),
]


@pytest.mark.parametrize(
    ("code", "phrase", "type_", "behavior", "reaction"),
    CLASSIFY_CASES,
    ids=[f"code={case[0]}" for case in CLASSIFY_CASES],
)
def test_classify_exit(code, phrase, type_, behavior, reaction):
    info = classify_exit(code)
    assert info.code == code  # the raw code is kept, also for the fallbacks
    assert (info.phrase, info.type, info.behavior, info.reaction) == (phrase, type_, behavior, reaction)


def test_code_zero_has_an_empty_reason():
    assert classify_exit(0).reason == ""


@pytest.mark.parametrize(
    ("code", "fallback"),
    [(1, UNDEFINED_POSITIVE_EXIT), (200, UNDEFINED_POSITIVE_EXIT), (-1, UNDEFINED_NEGATIVE_EXIT)],
    ids=["positive-1", "positive-200-reserved-range", "negative-1"],
)
def test_fallbacks_are_the_spec_entries_with_the_raw_code(code, fallback):
    assert code not in exit_spec()
    assert classify_exit(code) == dataclasses.replace(exit_spec()[fallback], code=code)


def test_fallback_codes_classify_as_themselves():
    assert classify_exit(256) is exit_spec()[256]
    assert classify_exit(-8000) is exit_spec()[-8000]


@pytest.mark.parametrize("bad", ["137", 1.0, None, True], ids=["str", "float", "none", "bool"])
def test_classify_exit_rejects_non_integers(bad):
    with pytest.raises(TypeError):
        classify_exit(bad)


NAMED = [
    ("EXIT_SUCCEEDED", EXIT_SUCCEEDED, 0, "Succeeded"),
    ("EXIT_PREEMPTED", EXIT_PREEMPTED, -1003, "PodPreemptedForCriticalPod"),
    ("EXIT_NODE_LOST", EXIT_NODE_LOST, -1001, "PodNodeLost"),
    ("EXIT_STOPPED", EXIT_STOPPED, -210, "StopFrameworkRequested"),
    ("EXIT_ATTEMPT_COMPLETED", EXIT_ATTEMPT_COMPLETED, -220, "FrameworkAttemptCompletion"),
    ("EXIT_LAUNCH_FAILED", EXIT_LAUNCH_FAILED, -1203, "ContainerDockerStartCmdNotFound"),
    ("EXIT_LIVENESS_FAILED", EXIT_LIVENESS_FAILED, -300, "PodFailedWithoutFailedContainer"),
    ("UNDEFINED_POSITIVE_EXIT", UNDEFINED_POSITIVE_EXIT, 256, "PAIRuntimeExitAbnormally"),
    ("UNDEFINED_NEGATIVE_EXIT", UNDEFINED_NEGATIVE_EXIT, -8000, "ContainerUndefinedNegativeExitCode"),
]


@pytest.mark.parametrize(("name", "value", "code", "phrase"), NAMED, ids=[n[0] for n in NAMED])
def test_named_codes_exist_in_the_spec(name, value, code, phrase):
    assert value == code
    assert code in exit_spec(), name
    assert exit_spec()[code].phrase == phrase


def test_named_codes_have_the_intended_reactions():
    spec = exit_spec()
    # platform causes are transient and always retried
    assert spec[EXIT_PREEMPTED].reaction == "ALWAYS_RETRY"
    assert spec[EXIT_NODE_LOST].reaction == "ALWAYS_RETRY"
    # stops are the user's and final
    assert spec[EXIT_STOPPED].type == "USER_STOP"
    assert spec[EXIT_STOPPED].reaction == "NEVER_RETRY"
    assert spec[EXIT_ATTEMPT_COMPLETED].type == "USER_STOP"
    # a launch failure is permanent; a liveness failure is bounded by jobRetryCount
    assert spec[EXIT_LAUNCH_FAILED].behavior == "PERMANENT"
    assert spec[EXIT_LAUNCH_FAILED].reaction == "NEVER_RETRY"
    assert spec[EXIT_LIVENESS_FAILED].reaction == "RETRY_TO_MAX"


def test_named_codes_are_distinct():
    values = [n[1] for n in NAMED]
    assert len(set(values)) == len(values)


def test_module_exports():
    for name in exitspec_module.__all__:
        assert hasattr(exitspec_module, name)
