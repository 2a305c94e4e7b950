"""The simulated GPU model: load-driven values and DCGM-like fault injection."""

from __future__ import annotations

import threading

import pytest
from tests.monitoring.helpers import parse, scrape, value

from apiary.monitoring.gpu import H100_SPEC, GpuCollector, SimulatedGpus
from apiary.monitoring.gpu_health import THROTTLE_FAULTS, THROTTLE_GPU_IDLE


def task(index: int, gpus: list[int], pid: int | None = None, job: str = "alice~train") -> dict:
    return {"job": job, "user": "alice", "virtual_cluster": "vc1", "task_role": "worker", "index": index,
            "pid": pid, "gpus": gpus}


def by_gpu(sim: SimulatedGpus) -> dict:
    return {s.index: s for s in sim.samples()}


def test_idle_gpus():
    sim = SimulatedGpus("sim-1", 4, clock=lambda: 1000.0)
    for s in sim.samples():
        assert s.util == 0 and s.fb_used_mib == 0 and s.fb_free_mib == 81920
        assert 30 <= s.temp_c <= 35
        assert 50 <= s.power_w <= 60
        assert s.name == "Simulated GPU" and s.uuid == f"GPU-SIM-sim-1-{s.index}" and s.device == f"nvidia{s.index}"
        assert s.ecc_dbe_vol == 0 and s.xid_last == 0 and s.process_pids == ()


def test_load_driven_and_deterministic():
    now = [1000.0]
    tasks = [task(0, [0, 1], pid=4242), task(1, [2])]
    sim = SimulatedGpus("sim-1", 4, tasks=lambda: tasks, clock=lambda: now[0])
    a = by_gpu(sim)
    assert a == by_gpu(SimulatedGpus("sim-1", 4, tasks=lambda: tasks, clock=lambda: now[0]))  # deterministic
    for g in (0, 1, 2):
        assert 60 <= a[g].util <= 95
        assert a[g].temp_c > a[3].temp_c + 25  # hotter with load
        assert a[g].power_w > a[3].power_w + 150
        assert a[g].fb_used_mib > 0.5 * 81920 and a[g].fb_used_mib + a[g].fb_free_mib == 81920
        assert a[g].sm_clock_mhz > a[3].sm_clock_mhz
    assert a[3].util == 0
    assert a[0].process_pids == (4242,) and a[2].process_pids == ()

    # the jitter moves with the period but stays in range; FB use (from the task's base load) does not move
    seen = set()
    for step in range(20):
        now[0] = 1000.0 + 5.0 * step
        b = by_gpu(sim)
        seen.add(b[0].util)
        assert 60 <= b[0].util <= 95
        assert b[0].fb_used_mib == a[0].fb_used_mib
    assert len(seen) > 1

    # another task -> another base load
    other = SimulatedGpus("sim-1", 4, tasks=lambda: [task(0, [0], job="bob~eval")], clock=lambda: 1000.0)
    assert by_gpu(other)[0].fb_used_mib != a[0].fb_used_mib


def test_faults_and_clear():
    sim = SimulatedGpus("sim-1", 2, tasks=lambda: [task(0, [0])], clock=lambda: 1000.0)
    normal = by_gpu(sim)

    assert sim.inject(1, ecc_dbe=2) == {"ecc_dbe": 2}
    sim.inject(1, ecc_dbe=1)
    assert by_gpu(sim)[1].ecc_dbe_vol == 3  # increments
    assert by_gpu(sim)[0].ecc_dbe_vol == 0

    sim.inject(0, xid=79)
    s = by_gpu(sim)[0]
    assert s.xid_last == 79 and s.xid_events == 1
    sim.inject(0, xid=48)
    assert by_gpu(sim)[0].xid_last == 48 and by_gpu(sim)[0].xid_events == 2

    sim.inject(0, temp=92)
    assert by_gpu(sim)[0].temp_c == 92
    assert by_gpu(sim)[0].util == normal[0].util  # a fault does not change the load

    sim.inject(0, ecc_sbe=5, pcie_replay=7, foreign=2)
    s = by_gpu(sim)[0]
    assert s.ecc_sbe_vol == 5 and s.pcie_replay == 7 and len(s.process_pids) == 2
    assert sim.faults() == {0: {"temp": 92.0, "xid": 48, "ecc_sbe": 5, "pcie_replay": 7, "foreign": 2},
                            1: {"ecc_dbe": 3}}

    sim.inject(1, lost=True)
    assert sorted(by_gpu(sim)) == [0]

    sim.clear(0)
    assert by_gpu(sim)[0] == normal[0]
    assert sorted(by_gpu(sim)) == [0]  # GPU 1 still lost
    sim.clear()
    assert by_gpu(sim) == normal
    assert sim.faults() == {}


def test_inject_validates():
    sim = SimulatedGpus("sim-1", 2)
    with pytest.raises(ValueError):
        sim.inject(2, xid=79)
    with pytest.raises(ValueError):
        sim.inject(0, ecc_dbe=-1)


def test_thread_safe_injection():
    sim = SimulatedGpus("sim-1", 1)

    def hammer():
        for _ in range(500):
            sim.inject(0, ecc_dbe=1)
            sim.samples()

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sim.samples()[0].ecc_dbe_vol == 4000


def test_collector_output_for_simulated_gpus():
    tasks = [task(0, [1], pid=777)]
    sim = SimulatedGpus("sim-1", 2, tasks=lambda: tasks, clock=lambda: 1000.0)
    sim.inject(0, xid=79, ecc_dbe=1, temp=95, foreign=1)
    s = parse(scrape(GpuCollector(sim, "sim-1", expected=2, task_pids=lambda: {777})))
    labels = dict(gpu="0", UUID="GPU-SIM-sim-1-0", device="nvidia0", modelName="Simulated GPU", Hostname="sim-1")
    assert value(s, "DCGM_FI_DEV_XID_ERRORS", **labels) == 79
    assert value(s, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", **labels) == 1
    assert value(s, "DCGM_FI_DEV_GPU_TEMP", **labels) == 95
    assert 60 <= value(s, "DCGM_FI_DEV_GPU_UTIL", gpu="1") <= 95
    assert value(s, "apiary_gpu_foreign_processes", Hostname="sim-1", gpu="0") == 1
    assert value(s, "apiary_gpu_foreign_processes", Hostname="sim-1", gpu="1") == 0  # the task's own pid
    assert value(s, "apiary_gpu_simulated", Hostname="sim-1") == 1
    assert "apiary_nvml_available" not in s
    assert value(s, "apiary_node_gpu_count", Hostname="sim-1") == 2


# ------------------------------------------------------------------------ health beyond ECC and XID


@pytest.mark.parametrize(("spec", "gen", "retired"), [
    pytest.param(None, 4, 0.0, id="a100-like-default"),
    pytest.param(H100_SPEC, 5, None, id="h100-like-gen5-no-page-retirement"),
])
def test_healthy_health_values_per_sku(spec, gen, retired):
    sim = SimulatedGpus("sim-1", 2, tasks=lambda: [task(0, [0])], clock=lambda: 1000.0, spec=spec)
    busy, idle = by_gpu(sim)[0], by_gpu(sim)[1]
    for s in (busy, idle):
        assert (s.pcie_link_gen, s.pcie_link_width, s.pcie_max_link_gen, s.pcie_max_link_width) == (gen, 16, gen, 16)
        assert (s.row_remap_failure, s.row_remap_pending, s.remapped_rows_unc, s.remapped_rows_corr) == (0, 0, 0, 0)
        assert s.retired_dbe == retired and s.retired_pending == (None if retired is None else 0.0)
    assert busy.throttle_reasons == 0 and idle.throttle_reasons == THROTTLE_GPU_IDLE  # NVML's "GPU idle" bit


def test_health_faults_change_the_metrics_and_clear_resets_them():
    sim = SimulatedGpus("sim-1", 2, tasks=lambda: [task(0, [0])], clock=lambda: 1000.0, spec=H100_SPEC)
    normal = by_gpu(sim)
    assert sim.inject(0, row_remap_failure=True) == {"row_remap_failure": True}
    sim.inject(0, row_remap_pending=True, throttle="thermal")
    sim.inject(1, pcie_gen=3, pcie_width=8, throttle="power")
    g0, g1 = by_gpu(sim)[0], by_gpu(sim)[1]
    assert (g0.row_remap_failure, g0.row_remap_pending, g0.remapped_rows_unc) == (1, 1, 1)
    assert g0.throttle_reasons == THROTTLE_FAULTS["thermal"]  # busy: no idle bit
    assert (g1.pcie_link_gen, g1.pcie_link_width, g1.pcie_max_link_gen, g1.pcie_max_link_width) == (3, 8, 5, 16)
    assert g1.throttle_reasons == THROTTLE_GPU_IDLE | THROTTLE_FAULTS["power"]
    assert sim.faults() == {0: {"row_remap_failure": True, "row_remap_pending": True, "throttle": "thermal"},
                            1: {"throttle": "power", "pcie_gen": 3, "pcie_width": 8}}
    assert g0.util == normal[0].util  # a health fault does not change the load
    sim.clear(0)
    assert by_gpu(sim)[0] == normal[0]
    sim.clear()
    assert by_gpu(sim) == normal and sim.faults() == {}


def test_retired_pages_count_up_on_a_sku_that_retires_pages():
    sim = SimulatedGpus("sim-1", 1, clock=lambda: 1000.0)
    sim.inject(0, retired_pages=2)
    sim.inject(0, retired_pages=1)
    s = sim.samples()[0]
    assert (s.retired_dbe, s.retired_sbe, s.retired_pending) == (3, 0, 1)


@pytest.mark.parametrize(("kinds", "spec", "message"), [
    pytest.param({"throttle": "cold"}, None, "throttle must be one of", id="unknown-throttle"),
    pytest.param({"pcie_gen": 5}, None, "pcie_gen must be in 1..4", id="gen-above-the-sku"),
    pytest.param({"pcie_gen": 0}, H100_SPEC, "pcie_gen must be in 1..5", id="gen-zero"),
    pytest.param({"pcie_width": 3}, None, "pcie_width must be one of", id="width-not-a-lane-count"),
    pytest.param({"pcie_width": 32}, None, "pcie_width must be one of", id="width-above-the-sku"),
    pytest.param({"retired_pages": -1}, None, "retired_pages must be >= 0", id="negative-pages"),
    pytest.param({"retired_pages": 1}, H100_SPEC, "remaps rows instead", id="pages-on-hopper"),
])
def test_health_faults_are_validated(kinds, spec, message):
    sim = SimulatedGpus("sim-1", 1, spec=spec)
    with pytest.raises(ValueError, match=message):
        sim.inject(0, **kinds)
    assert sim.faults() == {}  # nothing half-applied


def test_collector_exports_injected_health_faults():
    sim = SimulatedGpus("sim-1", 2, clock=lambda: 1000.0, spec=H100_SPEC)
    sim.inject(1, pcie_width=4, row_remap_failure=True)
    s = parse(scrape(GpuCollector(sim, "sim-1", expected=2)))
    labels = dict(gpu="1", UUID="GPU-SIM-sim-1-1", device="nvidia1", modelName="Simulated H100", Hostname="sim-1")
    assert value(s, "DCGM_FI_DEV_PCIE_LINK_WIDTH", **labels) == 4
    assert value(s, "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", **labels) == 16
    assert value(s, "DCGM_FI_DEV_ROW_REMAP_FAILURE", **labels) == 1
    assert value(s, "DCGM_FI_DEV_ROW_REMAP_FAILURE", gpu="0") == 0
    assert "DCGM_FI_DEV_RETIRED_DBE" not in s  # Hopper-like: NOT_SUPPORTED, left out
