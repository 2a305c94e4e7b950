"""The NVML GPU collector against a fake NVML -- no GPU here (tests.monitoring.fake_nvml, injected as
the module object), plus the real pynvml on this driverless machine (NVML unavailable path)."""

from __future__ import annotations

import logging

import pytest
from tests.monitoring.fake_nvml import MIB, FakeGpu, FakeNvml, NVMLError, NVMLError_LibraryNotFound
from tests.monitoring.helpers import parse, scrape, value

from apiary.monitoring.gpu import DCGM_FIELDS, DCGM_LABELS, GpuCollector, NvmlGpus


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(
                uuid="GPU-aaaa", minor=0, bus_id="00000000:07:00.0", util=87, mem_used=30000 * MIB + 123,
                temp=71, power_mw=312_456, sm_clock=1410, mem_clock=1593, ecc_sbe=4, ecc_dbe=0, pcie_replay=2,
                pids=[1001],
            ),
            FakeGpu(uuid="GPU-bbbb", minor=3, bus_id="00000000:0F:00.0", util=0, temp=33, ecc_sbe=None, ecc_dbe=None),
        ]
    )


def test_fake_names_exist_in_pynvml():
    """The fake only stands in for real pynvml names (functions and constants)."""
    import pynvml

    names = [n for n in vars(FakeNvml) if n.lower().startswith("nvml")]
    assert names and [n for n in names if not hasattr(pynvml, n)] == []
    for n in names:
        if n.startswith(("NVML_", "nvmlEventType")):
            assert getattr(FakeNvml, n) == getattr(pynvml, n), n


def test_dcgm_names_labels_and_values():
    nv = two_gpus()
    text = scrape(GpuCollector(NvmlGpus(nv), "node-a", expected=2, task_pids=lambda: {1001}))
    s = parse(text)
    gpu0 = dict(gpu="0", UUID="GPU-aaaa", device="nvidia0", pci_bus_id="00000000:07:00.0",
                modelName="NVIDIA A100-SXM4-80GB", Hostname="node-a")
    for _, name, _ in DCGM_FIELDS:
        assert name in s, name
        for sample in s[name]:
            assert set(sample.labels) == set(DCGM_LABELS)
    assert value(s, "DCGM_FI_DEV_GPU_UTIL", **gpu0) == 87
    assert value(s, "DCGM_FI_DEV_FB_USED", **gpu0) == 30000  # MiB, floored like NVML's used // MiB
    assert value(s, "DCGM_FI_DEV_FB_FREE", **gpu0) == 81920 - 30000 - 1
    assert value(s, "DCGM_FI_DEV_GPU_TEMP", **gpu0) == 71
    assert value(s, "DCGM_FI_DEV_POWER_USAGE", **gpu0) == pytest.approx(312.456)  # mW -> W
    assert value(s, "DCGM_FI_DEV_SM_CLOCK", **gpu0) == 1410
    assert value(s, "DCGM_FI_DEV_MEM_CLOCK", **gpu0) == 1593
    assert value(s, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", **gpu0) == 4
    assert value(s, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", **gpu0) == 0
    assert value(s, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", **gpu0) == 2
    assert value(s, "DCGM_FI_DEV_XID_ERRORS", **gpu0) == 0
    # the second GPU: device from the minor number; ECC not supported -> no ECC samples, others present
    assert value(s, "DCGM_FI_DEV_GPU_UTIL", gpu="1", device="nvidia3", UUID="GPU-bbbb") == 0
    assert [x.labels["gpu"] for x in s["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"]] == ["0"]
    assert value(s, "apiary_nvml_available", Hostname="node-a") == 1
    assert value(s, "apiary_nvml_info", Hostname="node-a", driver_version="550.54.15", reason="") == 1
    assert value(s, "apiary_gpu_simulated", Hostname="node-a") == 0
    assert value(s, "apiary_node_gpu_count", Hostname="node-a") == 2
    assert value(s, "apiary_node_gpu_expected", Hostname="node-a") == 2
    # the exposition declares the DCGM families under their exact names
    assert "# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL gauge" in text


def test_xid_from_event_set_without_blocking():
    nv = two_gpus()
    collector = GpuCollector(NvmlGpus(nv), "node-a")
    s = parse(scrape(collector))
    assert sorted(nv.registered) == [(0, 8), (1, 8)]  # both GPUs registered for XidCriticalError
    assert value(s, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == 0

    nv.fire_xid(1, 48)
    nv.fire_xid(1, 79)
    s = parse(scrape(collector))
    assert value(s, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == 79  # the last XID, as dcgm-exporter
    assert value(s, "DCGM_FI_DEV_XID_ERRORS", gpu="0") == 0
    assert value(s, "apiary_gpu_xid_errors_total", gpu="1") == 2
    assert set(nv.wait_timeouts) == {0}  # nvmlEventSetWait(set, 0): never blocks a scrape

    s = parse(scrape(collector))  # no new event: the last XID stays, the count too
    assert value(s, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == 79
    assert value(s, "apiary_gpu_xid_errors_total", gpu="1") == 2


def test_foreign_processes():
    nv = two_gpus()
    nv.devices[0].pids = [1001, 1002, 1003]
    nv.devices[1].pids = []
    calls = []

    def ours():
        calls.append(1)
        return {1001, 1002}

    s = parse(scrape(GpuCollector(NvmlGpus(nv), "node-a", task_pids=ours)))
    assert value(s, "apiary_gpu_foreign_processes", Hostname="node-a", gpu="0") == 1
    assert value(s, "apiary_gpu_foreign_processes", Hostname="node-a", gpu="1") == 0
    assert calls == [1]

    nv.devices[0].pids = []
    calls.clear()
    scrape(GpuCollector(NvmlGpus(nv), "node-a", task_pids=ours))
    assert calls == []  # no compute process anywhere: the platform's pids are not even listed


def test_lost_gpu_lowers_the_count():
    nv = two_gpus()
    nv.devices[1].lost = True
    s = parse(scrape(GpuCollector(NvmlGpus(nv), "node-a", expected=2)))
    assert value(s, "apiary_node_gpu_count", Hostname="node-a") == 1
    assert value(s, "apiary_node_gpu_expected", Hostname="node-a") == 2
    assert [x.labels["gpu"] for x in s["DCGM_FI_DEV_GPU_UTIL"]] == ["0"]


def test_init_failure_reports_unavailable_and_retries(caplog):
    nv = two_gpus()
    nv.init_error = NVMLError_LibraryNotFound()
    now = [1000.0]
    collector = GpuCollector(NvmlGpus(nv, retry_s=60, clock=lambda: now[0]), "node-a", expected=2)
    with caplog.at_level(logging.WARNING, logger="apiary.monitoring.gpu"):
        s = parse(scrape(collector))
        scrape(collector)
    assert value(s, "apiary_nvml_available", Hostname="node-a") == 0
    reason = s["apiary_nvml_info"][0].labels["reason"]
    assert "LibraryNotFound" in reason
    assert value(s, "apiary_node_gpu_count", Hostname="node-a") == 0
    assert "DCGM_FI_DEV_GPU_UTIL" not in s
    assert nv.init_calls == 1  # no retry before retry_s
    assert len([r for r in caplog.records if "NVML unavailable" in r.getMessage()]) == 1  # logged once

    nv.init_error = None
    now[0] += 61
    s = parse(scrape(collector))
    assert value(s, "apiary_nvml_available", Hostname="node-a") == 1
    assert value(s, "apiary_node_gpu_count", Hostname="node-a") == 2


def test_real_pynvml_without_driver(caplog):
    """The real pynvml on this machine: nvmlInit raises (no driver) -> apiary_nvml_available 0, no crash."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine")
    collector = GpuCollector(NvmlGpus(), "node-real", expected=8)
    with caplog.at_level(logging.WARNING, logger="apiary.monitoring.gpu"):
        s = parse(scrape(collector))
        s2 = parse(scrape(collector))
    for snap in (s, s2):
        assert value(snap, "apiary_nvml_available", Hostname="node-real") == 0
        assert value(snap, "apiary_node_gpu_count", Hostname="node-real") == 0
    assert snap["apiary_nvml_info"][0].labels["reason"].startswith("NVMLError")
    assert len([r for r in caplog.records if "NVML unavailable" in r.getMessage()]) == 1


# ------------------------------------------------------------------------ health beyond ECC and XID


class OldBindings(FakeNvml):
    """pynvml before the clocks "event" rename: only ``...ThrottleReasons`` exists."""

    nvmlDeviceGetCurrentClocksEventReasons = None  # type: ignore[assignment]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        return self._supported(self._dev(handle).throttle_reasons)


def health_gpus(cls: type[FakeNvml] = FakeNvml) -> FakeNvml:
    return cls(
        [
            # Hopper-like: rows remapped, one pending a reset; no page retirement; SW thermal + power cap;
            # a link trained at gen 3 of 5.
            FakeGpu(uuid="GPU-h100", name="NVIDIA H100 80GB HBM3", remapped_rows=(2, 1, 1, 0), retired_pages=None,
                    retired_pending=None, throttle_reasons=0x24, pcie=(3, 16, 5, 16)),
            # Volta-like: retires pages, no row remapper; an SXM board whose PCIe queries are unsupported.
            FakeGpu(uuid="GPU-v100", minor=1, name="Tesla V100-SXM2-32GB", remapped_rows=None,
                    retired_pages=([0x1000], [0x2000, 0x3000]), retired_pending=1, throttle_reasons=0x1, pcie=None),
        ]
    )


def test_health_metrics_with_dcgm_names_and_labels():
    s = parse(scrape(GpuCollector(NvmlGpus(health_gpus()), "node-h")))
    h100 = dict(gpu="0", UUID="GPU-h100", device="nvidia0", pci_bus_id="00000000:07:00.0",
                modelName="NVIDIA H100 80GB HBM3", Hostname="node-h")
    expected = {
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 2, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 1,
        "DCGM_FI_DEV_ROW_REMAP_PENDING": 1, "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0x24,
        "DCGM_FI_DEV_PCIE_LINK_GEN": 3, "DCGM_FI_DEV_PCIE_LINK_WIDTH": 16,
        "DCGM_FI_DEV_PCIE_MAX_LINK_GEN": 5, "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": 16,
    }
    for name, want in expected.items():
        assert value(s, name, **h100) == want, name
        assert all(set(x.labels) == set(DCGM_LABELS) for x in s[name]), name
    v100 = dict(gpu="1", UUID="GPU-v100", device="nvidia1")
    assert value(s, "DCGM_FI_DEV_RETIRED_SBE", **v100) == 1  # pages: the length of NVML's address list
    assert value(s, "DCGM_FI_DEV_RETIRED_DBE", **v100) == 2
    assert value(s, "DCGM_FI_DEV_RETIRED_PENDING", **v100) == 1
    assert value(s, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", **v100) == 0x1


@pytest.mark.parametrize(("names", "supported_by"), [
    pytest.param(["DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_RETIRED_DBE", "DCGM_FI_DEV_RETIRED_PENDING"], ["1"],
                 id="page-retirement-not-supported-on-hopper"),
    pytest.param(["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
                  "DCGM_FI_DEV_ROW_REMAP_PENDING", "DCGM_FI_DEV_ROW_REMAP_FAILURE"], ["0"],
                 id="row-remapping-not-supported-on-volta"),
    pytest.param(["DCGM_FI_DEV_PCIE_LINK_GEN", "DCGM_FI_DEV_PCIE_LINK_WIDTH", "DCGM_FI_DEV_PCIE_MAX_LINK_GEN",
                  "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH"], ["0"], id="pcie-not-supported"),
])
def test_not_supported_leaves_the_metric_out_for_that_gpu_only(caplog, names, supported_by):
    with caplog.at_level(logging.WARNING, logger="apiary.monitoring.gpu"):
        s = parse(scrape(GpuCollector(NvmlGpus(health_gpus()), "node-h")))
    for name in names:
        assert [x.labels["gpu"] for x in s[name]] == supported_by, name
    assert value(s, "apiary_node_gpu_count", Hostname="node-h") == 2  # the scrape is whole
    assert not [r for r in caplog.records if "cannot read" in r.getMessage()]  # NOT_SUPPORTED is not a warning


def test_other_nvml_errors_leave_the_metric_out_and_warn_once_per_gpu(caplog):
    nv = health_gpus()

    def broken(handle: int) -> tuple[int, int, int, int]:
        raise NVMLError(999)

    nv.nvmlDeviceGetRemappedRows = broken  # type: ignore[method-assign]
    collector = GpuCollector(NvmlGpus(nv), "node-h")
    with caplog.at_level(logging.WARNING, logger="apiary.monitoring.gpu"):
        s = parse(scrape(collector))
        scrape(collector)
    assert "DCGM_FI_DEV_ROW_REMAP_FAILURE" not in s
    assert value(s, "DCGM_FI_DEV_PCIE_LINK_GEN", gpu="0") == 3
    warned = [r.getMessage() for r in caplog.records if "cannot read remapped rows" in r.getMessage()]
    assert warned == ["GPU 0: cannot read remapped rows: error 999",
                      "GPU 1: cannot read remapped rows: error 999"]  # once per GPU, not per scrape


def test_older_bindings_read_the_throttle_reasons():
    s = parse(scrape(GpuCollector(NvmlGpus(health_gpus(OldBindings)), "node-h")))
    assert value(s, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", gpu="0") == 0x24


def test_bindings_without_a_health_call_leave_it_out():
    class Minimal(FakeNvml):
        nvmlDeviceGetRemappedRows = None  # type: ignore[assignment]

    s = parse(scrape(GpuCollector(NvmlGpus(health_gpus(Minimal)), "node-h")))
    assert "DCGM_FI_DEV_ROW_REMAP_FAILURE" not in s
    assert value(s, "DCGM_FI_DEV_PCIE_MAX_LINK_GEN", gpu="0") == 5
