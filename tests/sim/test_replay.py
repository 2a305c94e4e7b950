"""Trace replay: metrics, the sharing anomaly, plots, the baselines, the CLI and the what-if logic.

The fragmentation trace (``FRAGMENTING``) on two 8-GPU nodes, VC ``a`` = one node, VC ``b`` = the
other, both jobs arriving at t=0 in file order:

* ``quota`` places first fit: a's 4-GPU job on m0, b's 4-GPU job on m0, a's second 4-GPU job on m1.
  b's job ends at 10, leaving 4 free GPUs on each node.  At 20 b submits an 8-GPU job: within b's
  quota (8) but no node has 8 free GPUs, so it waits until a's jobs end at 1000, although b's
  private cluster (one empty 8-GPU node) would run it at once: sharing anomaly 980 s.
* ``hived`` keeps each VC on its own node: b's 8-GPU job starts at 20, anomaly 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.support.shared import PHILLY_2K, PHILLY_MACHINES
from typer.testing import CliRunner

from apiary.cli.main import app
from apiary.scheduler.types import GroupRequest, TaskRequest
from apiary.sim.cluster import Machine, machines_to_cluster
from apiary.sim.policies import FifoScheduler, QuotaScheduler
from apiary.sim.replay import replay
from apiary.sim.report import whatif

FRAGMENTING = """submit_s,duration_s,gpus,vc
0,1000,4,a
0,10,4,b
0,1000,4,a
20,100,8,b
"""


@pytest.fixture
def frag(tmp_path) -> tuple[Path, Path]:
    trace = tmp_path / "frag.csv"
    trace.write_text(FRAGMENTING)
    cfg = machines_to_cluster([Machine("m0", 8), Machine("m1", 8)], {"a": {8: 1}, "b": {8: 1}})
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(cfg.to_yaml())
    return trace, cluster


def test_sharing_anomaly_hived_zero_quota_positive(frag):
    trace, cluster = frag
    doc, _ = replay(trace, cluster=cluster, policies=["hived", "quota", "fifo"])
    p = doc["policies"]
    assert p["hived"]["sharing_anomaly_s"] == 0
    assert p["quota"]["sharing_anomaly_s"] == pytest.approx(980.0)
    assert p["fifo"]["sharing_anomaly_s"] is None
    assert p["hived"]["queue_delay_s"]["mean"] == 0
    assert p["quota"]["queue_delay_s"]["p99"] > 900
    for m in p.values():
        assert m["jobs"] == 4 and m["rejected"] == 0 and m["preemptions"] == 0
        assert set(m) >= {"jobs", "rejected", "wall_s", "queue_delay_s", "jct_s", "gpu_utilization", "preemptions",
                          "sharing_anomaly_s"}
        assert set(m["queue_delay_s"]) == set(m["jct_s"]) == {"mean", "p50", "p95", "p99"}
    # busy GPU-seconds: 4*1000 + 4*10 + 4*1000 + 8*100 over 16 GPUs x makespan (hived: 1000 s)
    assert p["hived"]["gpu_utilization"] == pytest.approx((8000 + 40 + 800) / (16 * 1000), abs=1e-6)


def test_rejections(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("submit_s,duration_s,gpus,vc\n0,10,16,a\n0,10,1,nosuchvc\n0,10,8,b\n")
    cfg = machines_to_cluster([Machine("m0", 8), Machine("m1", 8)], {"a": {8: 1}, "b": {8: 1}})
    (tmp_path / "c.yaml").write_text(cfg.to_yaml())
    doc, _ = replay(trace, cluster=tmp_path / "c.yaml", policies=["hived", "quota", "fifo"])
    assert doc["policies"]["hived"]["rejected"] == 2  # larger than VC a; unknown VC
    assert doc["policies"]["quota"]["rejected"] == 2
    assert doc["policies"]["fifo"]["rejected"] == 0  # no VCs: 16 GPUs fit the cluster


def test_plots_written(frag, tmp_path):
    trace, cluster = frag
    doc, _ = replay(trace, cluster=cluster, policies=["hived", "quota"], plots=tmp_path / "plots")
    files = sorted(Path(p).name for p in doc["plots"])
    assert files == ["gpu_utilization.png", "queue_delay_cdf.png"]
    for p in doc["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_philly_sample_on_machines():
    doc, _ = replay(PHILLY_2K, machines=PHILLY_MACHINES, policies=["hived", "quota", "fifo"])
    assert doc["cluster"]["nodes"] == 552 and doc["cluster"]["gpus"] == 2490
    assert sum(v["gpus"] for v in doc["cluster"]["virtualClusters"].values()) == 2490
    for name, m in doc["policies"].items():
        assert m["jobs"] + m["rejected"] == 2000, name
        assert 0 < m["gpu_utilization"] <= 1
    assert doc["policies"]["hived"]["sharing_anomaly_s"] == 0


def test_baselines_interface():
    cfg = machines_to_cluster([Machine("m0", 8), Machine("m1", 2)], {"a": {8: 1}, "b": {2: 1}})
    q = QuotaScheduler(cfg)
    big = GroupRequest("j1", "b", 100, True, (TaskRequest("t", 1, 4, 0.0, 0),))
    with pytest.raises(Exception, match="exceeds maximum 2 GPUs in VC b"):
        q.validate(big)
    req = GroupRequest("j2", "a", 100, True, (TaskRequest("t", 2, 4, 0.0, 0),))
    d = q.schedule(req)
    assert d.kind == "place" and [p.node for p in d.placements] == ["m0", "m0"]
    assert [p.leaf_cell_indices for p in d.placements] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    q.allocate("j2", req, d.placements)
    assert q.schedule(GroupRequest("j3", "a", 100, True, (TaskRequest("t", 1, 1, 0.0, 0),))).kind == "wait"
    q.release("j2")
    assert q.status()["usedGpus"] == 0
    f = FifoScheduler(cfg)
    q.set_node_health("m0", False)
    f.set_node_health("m0", False)
    assert f.schedule(GroupRequest("j4", "x", 100, True, (TaskRequest("t", 1, 4, 0.0, 0),))).kind == "wait"
    d = f.schedule(GroupRequest("j5", "x", 100, True, (TaskRequest("t", 1, 2, 0.0, 0),)))
    assert d.kind == "place" and d.placements[0].node == "m1"


def test_cli_trace_and_scenario(frag, tmp_path):
    trace, cluster = frag
    out = tmp_path / "out.json"
    r = CliRunner().invoke(app, ["sim", "trace", "--trace", str(trace), "--cluster", str(cluster), "--policy", "hived",
                                 "--policy", "quota", "--json", str(out), "--plots", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert list(doc["policies"]) == ["hived", "quota"]
    assert (tmp_path / "p" / "queue_delay_cdf.png").exists()
    r = CliRunner().invoke(app, ["sim", "trace", "--trace", str(trace)])
    assert r.exit_code == 2

    lab6 = Path(__file__).resolve().parents[2] / "examples" / "lab6"
    sc = tmp_path / "s.yaml"
    sc.write_text(f"cluster: {lab6 / 'hived-config-two-vcs.yaml'}\nevents:\n"
                  f"  - {{at: 0, user: alice, duration: 100, submit: {lab6 / 'job-config-1.yaml'}}}\n")
    r = CliRunner().invoke(app, ["sim", "scenario", str(sc), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["jobs"]["alice~job-config-1"]["finished"] == 100


def test_whatif_logic(frag, tmp_path):
    trace, cluster = frag
    rep = whatif(trace, cluster=cluster, policies=["hived", "quota"], out_dir=tmp_path / "w")
    assert [r["policy"] for r in rep["rows"]] == ["hived", "quota"]
    assert rep["rows"][1]["sharing_anomaly_s"] == pytest.approx(980.0)
    assert len(rep["plots"]) == 2
    assert all("data:image/png;base64," in md for md in rep["plots"].values())


def test_whatif_flow_is_defined():
    from flows.whatif import what_if_replay

    assert what_if_replay.name == "what-if-replay"
