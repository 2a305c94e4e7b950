"""Apiary on a real NVIDIA GPU: NVML's readings, a task's GPU isolation, and a node agent on NVML
running a PyTorch job. Marked ``gpu`` (``make test-gpu``); each test skips, saying why, where NVML
does not answer (no driver: this repository's CI machine) or PyTorch is not installed (it is not
in requirements.lock: CUDA wheels are gigabytes; ``.venv/bin/pip install torch`` on a GPU machine).
The stress drill's kernels on a real GPU are tests/drills/test_bench_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from apiary.embedded import Embedded
from apiary.monitoring.gpu import GpuCollector, NvmlGpus, probe_nvml
from apiary.runtime.env import build_task_env

pytestmark = pytest.mark.gpu

REPO_ROOT = Path(__file__).resolve().parents[2]


def _nvml_or_skip():
    probe = probe_nvml()
    if not probe.answers:
        pytest.skip(f"NVML does not answer here: {probe.reason}")
    return probe


def _torch_or_skip() -> None:
    torch = pytest.importorskip("torch", reason="PyTorch is not installed in this environment (pip install torch)")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")


def _samples(families) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in families:
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def test_nvml_exports_every_gpu_with_dcgm_names_and_live_values() -> None:
    probe = _nvml_or_skip()
    source = NvmlGpus()
    try:
        metrics = _samples(GpuCollector(source, "gpu-box", expected=probe.count).collect())
    finally:
        source.close()
    power = metrics["DCGM_FI_DEV_POWER_USAGE"]
    assert len(power) == probe.count
    assert all(v > 0 for _labels, v in power)  # a GPU draws power even idle (an H200: ~80 W)
    assert {labels["modelName"] for labels, _v in power} == set(probe.names)
    assert all(labels["UUID"].startswith("GPU-") and labels["Hostname"] == "gpu-box" for labels, _v in power)
    total = metrics["DCGM_FI_DEV_FB_FREE"][0][1] + metrics["DCGM_FI_DEV_FB_USED"][0][1]
    assert total > 1024  # MiB
    assert metrics["DCGM_FI_DEV_GPU_TEMP"][0][1] > 0
    assert metrics["apiary_nvml_available"][0][1] == 1


def _env(gpus: list[int]) -> dict[str, str]:
    return build_task_env(job_id="alice~iso", user="alice", job_name="iso", task_roles={"main": 1},
                          host_ips={("main", 0): "127.0.0.1"}, ports=None, task_role="main", index=0,
                          gpus=gpus, attempt=0, simulated_gpus=False)


@pytest.mark.parametrize(("gpus", "seen"), [([0], 1), ([], 0)], ids=["one-gpu", "no-gpu"])
def test_a_task_sees_exactly_its_gpus(gpus: list[int], seen: int) -> None:
    _nvml_or_skip()
    _torch_or_skip()
    env = {**os.environ, **_env(gpus)}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) == seen


ONE_NODE = """\
physicalCluster:
  skuTypes:
    GPU: {gpu: 1, cpu: 2, memory: 4096Mi}
  cellTypes:
    GPU-NODE: {childCellType: GPU, childCellNumber: 1, isNodeLevel: true}
    GPU-POOL: {childCellType: GPU-NODE, childCellNumber: 1}
  physicalCells:
  - cellType: GPU-POOL
    cellChildren:
    - cellAddress: gpu-box
virtualClusters:
  default:
    virtualCells:
    - {cellType: GPU-POOL.GPU-NODE, cellNumber: 1}
"""

#: 20 s of bf16 matrix products on the task's one GPU, then its result's checksum.
JOB = """\
protocolVersion: 2
name: gemm
type: job
taskRoles:
  main:
    instances: 1
    resourcePerInstance: {cpu: 1, memoryMB: 1024, gpu: 1}
    commands:
      - >-
        python3 -c "import time, torch; a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16);
        t = time.time(); busy = [torch.cuda.synchronize() for _ in iter(lambda: (a @ a, time.time() - t < 20)[1],
        False)]; print('gemm done', torch.cuda.device_count(), len(busy) > 0)"
defaults:
  virtualCluster: default
"""


def test_an_agent_on_nvml_runs_a_pytorch_job_and_attributes_its_gpu_use_to_it(tmp_path: Path) -> None:
    _nvml_or_skip()
    _torch_or_skip()
    cluster = tmp_path / "one-node.yaml"
    cluster.write_text(ONE_NODE)
    job_file = tmp_path / "gemm.yaml"
    job_file.write_text(JOB)
    emb = Embedded(home=tmp_path / "home", cluster=cluster, prefect=False, simulated_gpus=None,
                   workdir=str(REPO_ROOT))
    emb.start()
    try:
        assert emb.gpu_note.startswith("NVML on node gpu-box"), emb.gpu_note
        client = emb.client()
        deadline = time.monotonic() + 120
        node = None
        while time.monotonic() < deadline:
            nodes = [n for n in client.nodes() if n["name"] == "gpu-box" and n.get("ready") and n.get("metricsUrl")]
            if nodes:
                node = nodes[0]
                break
            time.sleep(1)
        assert node is not None and node["simulatedGpus"] is False, node
        job_id = client.submit(job_file)["id"]
        busy: list[float] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            text = httpx.get(node["metricsUrl"], timeout=10).text
            busy += [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("apiary_task_gpu_utilization_ratio{") and "gemm" in line]
            if client.get(job_id)["state"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(2)
        job = client.get(job_id)
        assert job["state"] == "SUCCEEDED", json.dumps(job)[:2000]
        assert max(busy, default=0.0) > 0.5, busy  # the job's GPU, busy with its products, counted as its own
        assert "gemm done 1 True" in str(client.logs(job_id, "main", 0))  # it saw one GPU, its own
    finally:
        emb.stop()
