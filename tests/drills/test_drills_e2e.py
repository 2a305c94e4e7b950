"""The inspection probe and the stress drill against a real platform (``apiary up``'s supervisor on
Lab 6's two-VC cluster: hostname-carol in VC default, hostname-dan in VC vc1, simulated GPUs).

* a ``degraded`` fault on hostname-dan's GPU 0 makes its benchmark run 10x slower and its simulated
  GPU figures fall tenfold; the stress drill flags and cordons that node only, by the CPU and the
  GPU rules, and /metrics says so (``apiary_drill_node_failed``);
* on a healthy platform the probe passes in every VC (``apiary_probe_success`` 1);
* with scheduling stopped (every node cordoned: nothing can be placed, the honest way to stop a
  scheduler from outside) the probe fails with the phase it was stuck in, /metrics shows
  ``apiary_probe_success`` 0, and the shipped rule fires on exactly those series (promtool).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tests.deploy.tools import PROMETHEUS_DIR
from tests.support.builders import LAB6
from tests.support.polling import nodes_ready, until

from apiary.auth.bootstrap import read_token
from apiary.client import Tenants
from apiary.drills.common import DrillApi
from apiary.drills.diagnosis import load_rules
from apiary.drills.inspection import run_inspection
from apiary.drills.stress import run_stress
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = pytest.mark.e2e

CAROL, DAN = "hostname-carol", "hostname-dan"
IMAGE = "python:3.11"


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    p = Embedded(home=tmp_path_factory.mktemp("apiary"), cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=False,
                 workdir=str(REPO_ROOT))
    p.start()
    p.start_supervisor(period_s=0.2)
    until(lambda: nodes_ready(Tenants(p.client()), 2), 60, "node agents")
    api = DrillApi(p.api_url, read_token(p.home / "token"))
    yield p, api
    api.close()
    p.stop()


def metrics(api: DrillApi) -> dict[tuple[str, tuple], float]:
    text = api._call("GET", "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def probe_success(api: DrillApi) -> dict[str, float]:
    return {dict(k[1])["virtual_cluster"]: v for k, v in metrics(api).items() if k[0] == "apiary_probe_success"}


def test_the_stress_drill_flags_and_cordons_only_the_degraded_node(platform) -> None:
    _, api = platform
    api.inject_fault(DAN, 0, degraded=10)  # queued before the drill's jobs: applied before they launch
    try:
        outcome = run_stress(api, load_rules(), image=IMAGE, timeout_s=150, poll_s=0.3)
        verdicts = {r["node"]: r["verdict"] for r in outcome.rows}
        assert verdicts == {CAROL: "passed", DAN: "FAILED"}, outcome.rows
        assert outcome.result == "failed" and outcome.details["cordoned"] == [DAN]
        dan = next(r for r in outcome.rows if r["node"] == DAN)
        assert "matmul-below-baseline" in dan["failedRules"] and "simulated slowdown x10" in dan["note"]
        # The simulated GPU figures: dan's GPU 0 is a tenth of carol's and of the reference.
        assert {"gpu-gemm-below-peers", "gpu-gemm-floor", "gpu-memory-floor"} <= set(dan["failedRules"].split(", "))
        assert "gpu0_gemm_bf16_tflops=" in dan["detail"] and "gpu0 simulated slowdown x10" in dan["note"]
        carol = next(r for r in outcome.rows if r["node"] == CAROL)
        assert carol["backend"] == dan["backend"] == "simulated"
        assert dan["gpuGemmTflopsMin"] < carol["gpuGemmTflopsMin"] / 5
        assert {n["name"]: n["cordoned"] for n in api.nodes()} == {CAROL: False, DAN: True}
        (held,) = api.node(DAN)["cordons"]  # the drill's own cordon, its failed rules the reason
        assert held["source"] == "drill:stress" and "matmul-below-baseline" in held["reason"]
        m = metrics(api)
        assert m[("apiary_drill_node_failed", (("node", DAN), ("rule", "matmul-below-baseline")))] == 1.0
        assert m[("apiary_drill_node_failed", (("node", DAN), ("rule", "gpu-gemm-floor")))] == 1.0
        assert not [k for k in m if k[0] == "apiary_drill_node_failed" and ("node", CAROL) in k[1]]
        assert m[("apiary_drill_result", (("drill", "stress-drill"),))] == 0.0
    finally:
        api.inject_fault(DAN, 0, clear=True)
        api.cordon(DAN, False, all=True)


def test_the_probe_passes_on_a_healthy_platform(platform) -> None:
    _, api = platform
    outcome = run_inspection(api, slo_s=90, image=IMAGE, poll_s=0.2)
    assert outcome.result == "passed", outcome.summary
    assert {r["virtualCluster"] for r in outcome.rows} == {"default", "vc1"}
    assert all(r["totalS"] >= r["scheduleS"] > 0 for r in outcome.rows)
    assert probe_success(api) == {"default": 1.0, "vc1": 1.0}
    assert metrics(api)[("apiary_drill_result", (("drill", "inspection"),))] == 1.0


def test_with_scheduling_stopped_the_probe_fails_and_the_alert_fires(platform, promtool: str, tmp_path: Path) -> None:
    _, api = platform
    for n in (CAROL, DAN):
        api.cordon(n, True)
    try:
        outcome = run_inspection(api, slo_s=4, image=IMAGE, poll_s=0.2)
    finally:
        for n in (CAROL, DAN):
            api.cordon(n, False)
    assert outcome.result == "failed"
    assert all(r["state"] == "WAITING" and r["reason"].startswith("still WAITING after the SLO of 4 s")
               for r in outcome.rows), outcome.rows
    assert all(api.get(r["job"])["state"] == "STOPPED" for r in outcome.rows)  # no late probe runs later
    live = probe_success(api)
    assert live == {"default": 0.0, "vc1": 0.0}
    # The shipped rule over the live values: a probe that passed, then this failure for 6 minutes
    # (the next probes, every 5 minutes, failing the same way while scheduling stays stopped).
    rule = yaml.safe_load((PROMETHEUS_DIR / "rules" / "drills.yml").read_text())["groups"][0]["rules"][0]
    assert rule["alert"] == "ApiaryInspectionProbeFailing"
    series = [{"series": f'apiary_probe_success{{job="apiary-control-plane",virtual_cluster="{vc}"}}',
               "values": f"1x3 {value:g}x30"} for vc, value in sorted(live.items())]
    expected = [{"exp_labels": {"severity": "error", "job": "apiary-control-plane", "virtual_cluster": vc},
                 "exp_annotations": {k: v.replace("{{ $labels.virtual_cluster }}", vc)
                                     for k, v in rule["annotations"].items()}} for vc in sorted(live)]
    test = {"rule_files": [str(PROMETHEUS_DIR / "rules" / "drills.yml")], "evaluation_interval": "15s",
            "tests": [{"interval": "15s", "input_series": series, "alert_rule_test": [
                {"eval_time": "3m", "alertname": "ApiaryInspectionProbeFailing", "exp_alerts": []},
                {"eval_time": "7m", "alertname": "ApiaryInspectionProbeFailing", "exp_alerts": expected}]}]}
    path = tmp_path / "probe_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
