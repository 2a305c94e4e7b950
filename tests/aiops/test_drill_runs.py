"""Drill runs: deterministic per seed, observed through the platform's exported metrics."""

from __future__ import annotations

import re
from pathlib import Path

from apiary.aiops import DRILL_INTERVAL_S, ScenarioConfig, generate_run, parse_exposition
from apiary.aiops.samples import SBE, TEMP

TINY = ScenarioConfig(nodes=4, intervals=30, failing_share=0.5, lead_intervals=(3, 8))
REPO = Path(__file__).resolve().parents[2]


def test_same_seed_same_run_other_seed_other_run() -> None:
    a, b, c = generate_run(7, TINY), generate_run(7, TINY), generate_run(8, TINY)
    assert a.frames == b.frames and a.fates == b.fates
    assert a.frames != c.frames


def test_interval_is_the_inspection_drills_cron() -> None:
    serve = (REPO / "flows" / "serve.py").read_text()
    cron = re.search(r'\(inspection, "inspection", "\*/(\d+) \* \* \* \*"', serve)
    assert cron is not None, "flows/serve.py no longer schedules the inspection drill as */N minutes"
    assert DRILL_INTERVAL_S == int(cron.group(1)) * 60


def test_precursors_are_read_back_from_the_exported_counters() -> None:
    run = next(r for r in (generate_run(s, TINY) for s in range(40))
               if any(f.fate == "degrading" and "ecc" in f.precursors for f in r.fates.values()))
    fate = next(f for f in run.fates.values() if f.fate == "degrading" and "ecc" in f.precursors)
    assert fate.fail_s is not None and fate.onset_s is not None and fate.gpu is not None
    before = [fr for fr in run.frames if fr.t < fate.onset_s][-1].nodes[fate.node].gpus[fate.gpu].sbe_total
    last = [fr for fr in run.frames if fr.t < fate.fail_s][-1].nodes[fate.node].gpus[fate.gpu].sbe_total
    assert before is not None and last is not None and last > before
    # the failure takes the GPU off the bus: one GPU fewer in the frame, then the node is gone
    at_fail = next(fr for fr in run.frames if fr.t == fate.fail_s)
    assert len(at_fail.nodes[fate.node].gpus) == TINY.gpus - 1
    assert all(fate.node not in fr.nodes for fr in run.frames if fr.t > fate.fail_s)


def test_parse_exposition_reads_dcgm_lines_and_skips_the_rest() -> None:
    text = (
        "# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).\n"
        'DCGM_FI_DEV_GPU_TEMP{Hostname="n1",gpu="0",modelName="A \\"quoted\\" name"} 71.0\n'
        'DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{Hostname="n1",gpu="0"} 12 1700000000000\n'
        'DCGM_FI_DEV_POWER_USAGE{Hostname="n1",gpu="0"} 300\n'
        "DCGM_FI_DEV_GPU_TEMP{broken\n"
    )
    rows = parse_exposition(text)
    assert [(n, v) for n, _, v in rows] == [(TEMP, 71.0), (SBE, 12.0)]
    assert rows[0][1]["modelName"] == 'A "quoted" name'
