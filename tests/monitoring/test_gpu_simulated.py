"""The simulated GPU model: load-driven values and DCGM-like fault injection."""

from __future__ import annotations

import threading

import pytest
from tests.monitoring.helpers import parse, scrape, value

from apiary.monitoring.gpu import GpuCollector, SimulatedGpus


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
