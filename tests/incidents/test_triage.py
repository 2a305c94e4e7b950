"""Job-failure triage: realistic log tails -> user / platform / hardware, the exit-spec fallback, rates."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from apiary.errors import ValidationError
from apiary.incidents import (
    Classification,
    FailureClass,
    classify_failure,
    default_rules,
    parse_rules,
    platform_failure_rate,
    should_open_incident,
)
from apiary.lifecycle import EXIT_NODE_LOST, EXIT_PREEMPTED, EXIT_STOPPED, exit_spec

U, P, H = FailureClass.USER, FailureClass.PLATFORM, FailureClass.HARDWARE

TRACEBACK = """\
[2024-05-01 10:00:01] epoch 0 step 0 loss 2.31
Traceback (most recent call last):
  File "/workspace/train.py", line 3, in <module>
{inner}
"""

CASES = [
    # --- user: the bulk of failures in Jeon et al.
    ("module-not-found", 1, TRACEBACK.format(inner="    import torchvisionn\nModuleNotFoundError: No module named "
                                                   "'torchvisionn'"), U, "python-import-error"),
    ("import-error", 1, TRACEBACK.format(inner="ImportError: cannot import name 'Foo' from 'models' "
                                               "(/workspace/models.py)"), U, "python-import-error"),
    ("syntax-error", 1, '  File "/workspace/train.py", line 12\n    for i in range(10)\n'
                        '                      ^\nSyntaxError: expected \':\'', U, "python-syntax-error"),
    ("indentation-error", 1, "IndentationError: unexpected indent", U, "python-syntax-error"),
    ("file-not-found", 1, TRACEBACK.format(inner="FileNotFoundError: [Errno 2] No such file or directory: "
                                                 "'/data/imagenet/train'"), U, "missing-file"),
    ("shell-missing-file", 2, "python: can't open file '/workspace/trian.py': [Errno 2] No such file or directory",
     U, "missing-file"),
    ("cuda-oom-torch", 1, TRACEBACK.format(
        inner="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB "
              "total capacity; 13.20 GiB already allocated; 1.02 GiB free)"), U, "cuda-out-of-memory"),
    ("cuda-oom-runtime-error", 1, "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB", U,
     "cuda-out-of-memory"),
    ("tf-oom", 1, "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor "
                  "with shape[64,1024,1024]\n  RESOURCE_EXHAUSTED: OOM when allocating tensor", U,
     "cuda-out-of-memory"),
    ("permission", 1, "PermissionError: [Errno 13] Permission denied: '/checkpoints/model.pt'", U,
     "permission-denied"),
    ("value-error", 1, TRACEBACK.format(inner="ValueError: Expected input batch_size (32) to match target "
                                              "batch_size (64)."), U, "python-exception"),
    ("nccl-invalid-usage", 1, "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1275, "
                              "invalid usage, NCCL version 2.18.1\nncclInvalidUsage: This usually reflects invalid "
                              "usage of NCCL library.", U, "nccl-invalid-usage"),
    # --- platform: runtime, network, lost nodes
    ("nccl-system-error", 1, "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1269, "
                             "unhandled system error, NCCL version 2.14.3\nncclSystemError: System call (e.g. socket,"
                             " malloc) or external library call failed or device error.", P, "nccl-error"),
    ("nccl-watchdog", 1, "[E ProcessGroupNCCL.cpp:828] [Rank 1] Watchdog caught collective operation timeout: "
                         "WorkNCCL(SeqNum=1, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800319 milliseconds",
     P, "nccl-error"),
    ("connection-reset", 1, TRACEBACK.format(inner="ConnectionResetError: [Errno 104] Connection reset by peer"), P,
     "connection-reset"),
    ("gloo-connection-reset", 1, "RuntimeError: [/opt/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                                 "[10.0.0.2]:23456\nread: Connection reset by peer", P, "connection-reset"),
    ("mpi", 1, "ORTE has lost communication with a remote daemon.", P, "mpi-runtime"),
    ("stale-nfs", 1, "OSError: [Errno 116] Stale file handle: '/mnt/nfs/data/shard-00012'", P, "shared-storage"),
    ("rendezvous-timeout", 1, "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. "
                              "1/2 clients joined.", P, "infrastructure-timeout"),
    ("node-lost", EXIT_NODE_LOST, "epoch 3 step 1200 loss 0.8\n", P, "node-lost"),
    # a node-lost task's last lines do not decide: the exit code does
    ("node-lost-with-noise", EXIT_NODE_LOST, "FileNotFoundError: [Errno 2] No such file: 'cache.tmp' (ignored)", P,
     "node-lost"),
    # --- hardware: ECC and XID, even inside a user-side exception
    ("xid-79", 1, "NVRM: Xid (PCI:0000:3b:00): 79, pid=21345, GPU has fallen off the bus.", H, "gpu-xid"),
    ("xid-short", 1, "dmesg: Xid 79 on GPU 0", H, "gpu-xid"),
    ("fallen-off-bus", 1, "Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost. "
                          "GPU has fallen off the bus.", H, "gpu-fallen-off-bus"),
    ("uncorrectable-ecc", 1, TRACEBACK.format(inner="RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
                                                    "CUDA kernel errors might be asynchronously reported"), H,
     "gpu-uncorrectable-ecc"),
    ("ecc-driver-api", 1, "F tensorflow/core/common_runtime/gpu/gpu_event_mgr.cc:208] Unexpected Event status: 1 "
                          "CUDA_ERROR_ECC_UNCORRECTABLE", H, "gpu-uncorrectable-ecc"),
    ("exit-spec-hardware", 223, "", H, "exit-spec-hardware"),
]


@pytest.mark.parametrize(("exit_code", "log", "klass", "rule"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_realistic_log_tails(exit_code, log, klass, rule):
    c = classify_failure(exit_code, log)
    assert (c.klass, c.rule) == (klass, rule)
    assert c.exit_code == exit_code and c.runbook
    if rule not in ("node-lost", "exit-spec-hardware"):
        assert c.evidence_line and c.evidence_line in [line.strip() for line in log.splitlines()]


def test_the_evidence_is_the_last_matching_line():
    log = "ModuleNotFoundError: No module named 'a'\nwarming up\nModuleNotFoundError: No module named 'b'\nbye"
    assert classify_failure(1, log).evidence_line == "ModuleNotFoundError: No module named 'b'"
    assert classify_failure(1, log.splitlines()).evidence_line == "ModuleNotFoundError: No module named 'b'"


@pytest.mark.parametrize(
    ("exit_code", "klass", "rule"),
    [
        (1, FailureClass.UNKNOWN, "exit-spec:PAIRuntimeExitAbnormally"),  # undefined: the program's own exit
        (-42, FailureClass.UNKNOWN, "exit-spec:ContainerUndefinedNegativeExitCode"),
        (137, P, "exit-spec:ContainerSigKillReceived"),
        (-1200, U, "exit-spec:UserContainerDockerOOMKilled"),
        (-1203, P, "exit-spec:ContainerDockerStartCmdNotFound"),  # the spec says PLATFORM_FAILURE
        (-300, FailureClass.UNKNOWN, "exit-spec:PodFailedWithoutFailedContainer"),
        (0, FailureClass.NONE, "exit-spec:Succeeded"),
        (EXIT_STOPPED, FailureClass.NONE, "exit-spec:StopFrameworkRequested"),
        (EXIT_PREEMPTED, FailureClass.NONE, "exit-spec:PodPreemptedForCriticalPod"),
    ],
    ids=lambda v: str(v) if isinstance(v, int) else None,
)
def test_the_exit_spec_is_the_fallback(exit_code, klass, rule):
    c = classify_failure(exit_code, "step 10 loss 0.5\nsaving checkpoint\n")
    assert (c.klass, c.rule, c.evidence_line) == (klass, rule, "")


def test_a_stop_or_preemption_is_never_read_as_a_failure():
    log = "NCCL error: unhandled system error\nXid 79"
    assert classify_failure(EXIT_PREEMPTED, log).klass == FailureClass.NONE
    assert classify_failure(EXIT_STOPPED, log).klass == FailureClass.NONE


def test_only_the_tail_is_read():
    log = ["ModuleNotFoundError: No module named 'x'"] + ["noise"] * 1000
    assert classify_failure(1, log).klass == FailureClass.UNKNOWN


def test_exit_code_must_be_an_int():
    with pytest.raises(TypeError):
        classify_failure("1", "")  # type: ignore[arg-type]


def test_the_hardware_exit_codes_are_the_specs_hardware_causes():
    spec_text = resources.files("apiary.lifecycle").joinpath("k8s-job-exit-spec.yaml").read_text()
    hw = {e["code"] for e in yaml.safe_load(spec_text)["spec"] if e.get("causer") == "PAI_HW"}
    (rule,) = [r for r in default_rules().rules if r.name == "exit-spec-hardware"]
    assert rule.exit_codes == hw and rule.klass == H
    assert all(code in exit_spec() for r in default_rules().rules for code in r.exit_codes)


def test_the_packaged_rules_are_well_formed():
    rules = default_rules().rules
    assert len({r.name for r in rules}) == len(rules)
    assert {r.klass for r in rules} == {U, P, H}
    assert all(r.runbook for r in rules)


def test_custom_rules_first_match_wins():
    rules = parse_rules({"version": 1, "rules": [
        {"name": "our-storage", "class": "platform", "patterns": ["(?i)lustre"], "runbook": "page storage"},
        {"name": "anything-else", "class": "user", "patterns": ["Error"]},
        {"name": "exit-3-with-oops", "class": "hardware", "exit_codes": [3], "patterns": ["oops"]},
    ]})
    assert classify_failure(1, "OSError: LustreError: timeout", rules).rule == "our-storage"
    assert classify_failure(1, "KeyError: 'x'", rules).rule == "anything-else"
    assert classify_failure(3, "oops", rules).rule == "exit-3-with-oops"
    assert classify_failure(4, "oops", rules).rule.startswith("exit-spec:")  # both conditions are needed


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([], "triageRules"),
        ({"rules": []}, "triageRules.rules"),
        ({"version": 2, "rules": [{"name": "a", "class": "user", "patterns": ["x"]}]}, "triageRules.version"),
        ({"rules": [{"name": "a", "class": "user", "patterns": ["x"]}], "extra": 1}, "triageRules.extra"),
        ({"rules": [{"class": "user", "patterns": ["x"]}]}, "triageRules.rules[0].name"),
        ({"rules": [{"name": "a", "class": "user", "patterns": ["x"]},
                    {"name": "a", "class": "user", "patterns": ["y"]}]}, "triageRules.rules[1].name"),
        ({"rules": [{"name": "a", "class": "none", "patterns": ["x"]}]}, "triageRules.rules[0].class"),
        ({"rules": [{"name": "a", "class": "user", "patterns": ["x", "(unclosed"]}]},
         "triageRules.rules[0].patterns[1]"),
        ({"rules": [{"name": "a", "class": "user", "patterns": "x"}]}, "triageRules.rules[0].patterns"),
        ({"rules": [{"name": "a", "class": "user", "exit_codes": ["1"]}]}, "triageRules.rules[0].exit_codes"),
        ({"rules": [{"name": "a", "class": "user"}]}, "triageRules.rules[0]"),
        ({"rules": [{"name": "a", "class": "user", "patterns": ["x"], "regex": "y"}]},
         "triageRules.rules[0].regex"),
    ],
    ids=["not-a-mapping", "no-rules", "version", "unknown-key", "no-name", "duplicate-name", "bad-class",
         "bad-regex", "patterns-not-list", "codes-not-ints", "no-condition", "unknown-rule-key"],
)
def test_malformed_rules_name_the_field(data, field):
    with pytest.raises(ValidationError) as err:
        parse_rules(data)
    assert err.value.field == field


def c(klass: FailureClass) -> Classification:
    return Classification(klass, "r", "")


def test_platform_failure_rate():
    window = [c(U)] * 6 + [c(P)] * 2 + [c(H)] + [c(FailureClass.UNKNOWN)] + [c(FailureClass.NONE)] * 5
    assert platform_failure_rate(window) == pytest.approx(3 / 10)
    assert platform_failure_rate(window, classes=[P]) == pytest.approx(2 / 10)
    assert platform_failure_rate([]) == 0.0
    assert platform_failure_rate([c(FailureClass.NONE)]) == 0.0


@pytest.mark.parametrize(
    ("rate", "failures", "expected"),
    [(0.25, 3, True), (0.2499, 3, False), (0.25, 2, False), (1.0, 2, False), (1.0, 30, True), (0.0, 0, False)],
    ids=["at-both-bounds", "rate-just-below", "too-few", "one-unlucky-job", "outage", "quiet"],
)
def test_should_open_incident(rate, failures, expected):
    assert should_open_incident(rate, 0.25, 3, failures=failures) is expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"rate": 1.5}, "rate"), ({"rate": float("nan")}, "rate"), ({"threshold": -0.1}, "threshold"),
     ({"min_failures": 0}, "min_failures"), ({"failures": -1}, "failures")],
    ids=["rate>1", "rate-nan", "threshold<0", "min-failures-0", "failures<0"],
)
def test_should_open_incident_checks_its_arguments(kwargs, field):
    args = {"rate": 0.5, "threshold": 0.25, "min_failures": 3, "failures": 5, **kwargs}
    with pytest.raises(ValidationError) as err:
        should_open_incident(args.pop("rate"), args.pop("threshold"), args.pop("min_failures"), **args)
    assert err.value.field == field
