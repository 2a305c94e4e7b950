"""leaf_cells_needed: OpenPAI's rule for the leaf cells of one task instance, the one definition
HivedScheduler and the simulator's baselines share."""

from __future__ import annotations

import pytest

from apiary.scheduler.sizing import UNPLACEABLE, leaf_cells_needed
from apiary.scheduler.types import TaskRequest
from apiary.spec.cluster import SkuType

# A DGX-like leaf cell: 1 GPU, 8 cores, 64 GiB.
GPU = SkuType(gpu=1, cpu=8, memory="64Gi")
# A CPU-only leaf cell: no GPU, 4 cores, 16 GiB.
CPU = SkuType(gpu=0, cpu=4, memory="16Gi")
# A fractional-core leaf cell (cores are floats in HiveD's skuTypes).
THIN = SkuType(gpu=1, cpu=0.7, memory="4Gi")


def task(gpu: int = 0, cpu: float = 0.0, memory_mb: int = 0) -> TaskRequest:
    return TaskRequest("t", 1, gpu, cpu, memory_mb)


@pytest.mark.parametrize(
    ("request_", "sku", "cells"),
    [
        pytest.param(task(), GPU, 1, id="nothing-asked-is-still-one-cell"),
        pytest.param(task(gpu=1, cpu=8, memory_mb=65536), GPU, 1, id="exactly-one-cell"),
        pytest.param(task(gpu=4), GPU, 4, id="gpu-bound"),
        pytest.param(task(gpu=1, cpu=20), GPU, 3, id="cpu-bound-rounds-up"),
        pytest.param(task(gpu=1, memory_mb=65537), GPU, 2, id="memory-bound-one-mib-over"),
        pytest.param(task(gpu=2, cpu=30, memory_mb=200_000), GPU, 4, id="the-scarcest-dimension-wins"),
        pytest.param(task(cpu=2.1), THIN, 3, id="float-cores-tolerate-rounding"),
        pytest.param(task(cpu=2.2), THIN, 4, id="float-cores-over-a-cell"),
        pytest.param(task(gpu=1), CPU, UNPLACEABLE, id="gpu-on-a-cpu-only-sku"),
        pytest.param(task(cpu=6, memory_mb=16384), CPU, 2, id="cpu-only-task"),
    ],
)
def test_leaf_cells_needed(request_: TaskRequest, sku: SkuType, cells: int) -> None:
    assert leaf_cells_needed(request_, sku) == cells
