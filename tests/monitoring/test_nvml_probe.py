"""``probe_nvml``: what ``apiary up`` asks NVML once at start (how many GPUs, their names), against
the fake NVML, and the real pynvml on a machine without a driver."""

from __future__ import annotations

from tests.monitoring.fake_nvml import FakeGpu, FakeNvml, NVMLError_LibraryNotFound

from apiary.monitoring.gpu import probe_nvml


def test_nvml_answering_gives_the_gpus_names_and_driver_and_shuts_nvml_down() -> None:
    nvml = FakeNvml([FakeGpu(name="NVIDIA H200"), FakeGpu(name=b"NVIDIA H200", minor=1)], driver="550.54.15")
    probe = probe_nvml(nvml)
    assert probe.answers and probe.count == 2
    assert probe.names == ("NVIDIA H200", "NVIDIA H200") and probe.driver == "550.54.15"
    assert not nvml.initialized  # nvmlShutdown: the agents initialise NVML for themselves


def test_no_driver_is_a_probe_that_does_not_answer_with_the_reason() -> None:
    probe = probe_nvml(FakeNvml([FakeGpu()], init_error=NVMLError_LibraryNotFound()))
    assert not probe.answers and probe.count == 0
    assert probe.reason == "NVMLError_LibraryNotFound: NVML Shared Library Not Found"


def test_nvml_without_a_gpu_does_not_answer() -> None:
    probe = probe_nvml(FakeNvml([]))
    assert not probe.answers and "sees no GPU" in probe.reason


def test_a_gpu_that_fails_to_answer_makes_the_probe_fail_not_raise() -> None:
    probe = probe_nvml(FakeNvml([FakeGpu(lost=True)]))
    assert not probe.answers and "GPU is lost" in probe.reason


def test_the_real_pynvml_never_raises() -> None:
    probe = probe_nvml()  # this machine: no driver (a reason), or a GPU machine (names)
    assert probe.answers == bool(probe.names) and (probe.answers or probe.reason)
