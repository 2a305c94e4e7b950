"""deploy/prometheus: config and alert rules, checked with promtool and by reading them.

* ``promtool check config`` / ``check rules`` / ``test rules`` (every file in
  deploy/prometheus/tests) through subprocess; they skip without promtool, and fail under CI=true.
* Static contracts that need no tool: every alert has a severity of OpenPAI's four levels, a
  summary and a description; every alert has a unit test in which it fires (with labels and
  annotations) and one in which it must not; the rules use only metric names the exporters
  publish; the scrape configuration keeps the labels the rules and Alertmanager rely on.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from tests.deploy.promql import KNOWN_METRICS, metric_names
from tests.deploy.tools import PROMETHEUS_DIR

RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
TEST_FILES = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
SEVERITIES = {"info", "warn", "error", "fatal"}


def _load(path: Path):
    return yaml.safe_load(path.read_text())


def _alerts() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path in RULE_FILES:
        for group in _load(path)["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    assert rule["alert"] not in out, f"alert {rule['alert']} defined twice"
                    out[rule["alert"]] = {**rule, "_file": path.name}
    return out


def _run(cmd: list[str], cwd: Path = PROMETHEUS_DIR) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rule_files_exist() -> None:
    assert [p.name for p in RULE_FILES] == [
        "ci.yml", "drills.yml", "gpu.yml", "incidents.yml", "jobs.yml", "node.yml", "services.yml"]
    assert TEST_FILES, "no promtool unit tests in deploy/prometheus/tests"


# --------------------------------------------------------------------------------------- promtool


def test_promtool_check_config(promtool: str) -> None:
    """The config parses, and so do the rule files and the file_sd targets it names."""
    r = _run([promtool, "check", "config", "prometheus.yml"])
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_rules(promtool: str) -> None:
    r = _run([promtool, "check", "rules", *[str(p.relative_to(PROMETHEUS_DIR)) for p in RULE_FILES]])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(_alerts())} rules found" in r.stdout or "SUCCESS" in r.stdout


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(promtool: str, test_file: Path) -> None:
    r = _run([promtool, "test", "rules", str(test_file.relative_to(PROMETHEUS_DIR))])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


# ------------------------------------------------------------------------------- static contracts


def test_every_alert_has_severity_summary_and_description() -> None:
    alerts = _alerts()
    assert len(alerts) >= 13
    for name, rule in alerts.items():
        assert name.startswith("Apiary"), name
        assert rule.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity must be one of {SEVERITIES}"
        ann = rule.get("annotations", {})
        assert ann.get("summary", "").strip(), f"{name}: no summary"
        assert ann.get("description", "").strip(), f"{name}: no description"
        assert "for" in rule, f"{name}: state `for:` explicitly (0s for alerts that fire at once)"


def test_required_alerts_and_severities() -> None:
    expected = {
        "ApiaryGpuEccDoubleBitError": "fatal",
        "ApiaryGpuXidError": "error",
        "ApiaryGpuUsedByForeignProcess": "warn",
        "ApiaryGpuCountChanged": "error",
        "ApiaryGpuTooHot": "warn",
        "ApiaryGpuRowRemapFailure": "error",
        "ApiaryGpuPcieLinkDegraded": "error",
        "ApiaryGpuThermalThrottling": "warn",
        "ApiaryGpuPowerThrottling": "warn",
        "ApiaryGpuHwSlowdown": "warn",
        "ApiaryNodeDown": "fatal",
        "ApiaryNodeDiskFull": "warn",
        "ApiaryNodeMemoryPressure": "warn",
        "ApiaryNodeAgentDown": "error",
        "ApiaryControlPlaneDown": "error",
        "ApiaryJobWaitingTooLong": "info",
        "ApiaryJobLowGpuUtilization": "info",
        "ApiarySchedulingStuck": "error",
    }
    alerts = _alerts()
    for name, severity in expected.items():
        assert name in alerts, f"missing alert {name}"
        assert alerts[name]["labels"]["severity"] == severity, name
    # Integration tests rely on the DBE alert firing on the first evaluation.
    assert alerts["ApiaryGpuEccDoubleBitError"]["for"] == "0s"
    assert alerts["ApiaryNodeDown"]["for"] == "30s"
    # A row-remapping failure cordons at once; throttling warns only once it is sustained.
    assert alerts["ApiaryGpuRowRemapFailure"]["for"] == "0s"
    for name in ("ApiaryGpuThermalThrottling", "ApiaryGpuPowerThrottling", "ApiaryGpuHwSlowdown"):
        assert alerts[name]["for"] == "5m", name
    assert 'up{job="apiary-node"} == 0' in alerts["ApiaryNodeDown"]["expr"]


def test_rules_use_only_exported_metrics() -> None:
    for name, rule in _alerts().items():
        names = metric_names(rule["expr"])
        assert names, f"{name}: no metric found in {rule['expr']!r}"
        unknown = names - KNOWN_METRICS
        assert not unknown, f"{name} uses metrics no exporter publishes: {sorted(unknown)}"


def _unit_tests() -> list[tuple[Path, dict, dict]]:
    """(test file, test group, alert_rule_test) for every alert test case."""
    out = []
    for path in TEST_FILES:
        doc = _load(path)
        for group in doc["tests"]:
            for case in group.get("alert_rule_test", []):
                out.append((path, group, case))
    return out


def test_every_alert_has_a_positive_and_a_negative_unit_test() -> None:
    cases = _unit_tests()
    for name in _alerts():
        mine = [c for _, _, c in cases if c["alertname"] == name]
        positive = [c for c in mine if c.get("exp_alerts")]
        negative = [c for c in mine if not c.get("exp_alerts")]
        assert positive, f"{name}: no unit test where it fires"
        assert negative, f"{name}: no unit test where it must not fire"
        for case in positive:
            for exp in case["exp_alerts"]:
                assert exp.get("exp_labels", {}).get("severity"), f"{name}: expected labels lack severity"
                ann = exp.get("exp_annotations", {})
                assert ann.get("summary") and ann.get("description"), f"{name}: expected annotations incomplete"


def test_unit_tests_load_every_rule_file() -> None:
    loaded = set()
    for path in TEST_FILES:
        for rf in _load(path)["rule_files"]:
            loaded.add((path.parent / rf).resolve())
    assert loaded == {p.resolve() for p in RULE_FILES}


def test_summaries_name_the_node_gpu_or_job() -> None:
    """In every firing unit test, the rendered summary names the alert's node, GPU and (Apiary) job."""
    for path, _, case in _unit_tests():
        for exp in case.get("exp_alerts") or []:
            labels, summary = exp["exp_labels"], exp["exp_annotations"]["summary"]
            where = f"{path.name}: {case['alertname']}: {summary!r}"
            if "node" in labels:
                assert labels["node"] in summary, where
            if "gpu" in labels:
                assert f"GPU {labels['gpu']}" in summary, where
            if path.name == "jobs_test.yml":
                assert labels["job"] in summary, where


def test_node_scoped_alerts_carry_node() -> None:
    """Alerts over series that name a node (Hostname or node) must carry `node` for Alertmanager."""
    for path, group, case in _unit_tests():
        node_series = any(("Hostname=" in s["series"] or "node=" in s["series"]) for s in group["input_series"])
        for exp in case.get("exp_alerts") or []:
            if node_series and path.name != "jobs_test.yml":
                assert "node" in exp["exp_labels"], f"{path.name}: {case['alertname']} lacks `node`"


# --------------------------------------------------------------------------------- prometheus.yml


def test_prometheus_config_contract() -> None:
    cfg = _load(PROMETHEUS_DIR / "prometheus.yml")
    assert sorted(cfg["rule_files"]) == sorted(f"rules/{p.name}" for p in RULE_FILES)
    am = cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == ["127.0.0.1:9093"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"apiary-control-plane", "apiary-node"}
    # Apiary's own `job` / `instance` labels (Apiary job name, heartbeat instance) must survive scraping.
    assert all(j.get("honor_labels") is True for j in jobs.values())
    node = jobs["apiary-node"]
    assert node["file_sd_configs"][0]["files"] == ["targets/nodes.json"]
    # Hostname -> node on every sample, and node from the address when nodes.json gives none.
    mr = node["metric_relabel_configs"]
    assert any(r["source_labels"] == ["Hostname"] and r["target_label"] == "node" for r in mr)
    assert any(r.get("target_label") == "node" for r in node["relabel_configs"])


def test_nodes_json_example() -> None:
    groups = json.loads((PROMETHEUS_DIR / "targets" / "nodes.json").read_text())
    assert isinstance(groups, list) and groups
    for g in groups:
        assert g["targets"] and all(":" in t for t in g["targets"])
        assert g["labels"]["node"]


def test_readme_documents_markers_and_alerts() -> None:
    """deploy/prometheus/README.md lists every `# apiary:` line `apiary up --monitoring` rewrites, and every alert."""
    readme = (PROMETHEUS_DIR / "README.md").read_text()
    deploy = PROMETHEUS_DIR.parent
    markers = set()
    for path in [*deploy.rglob("*.yml")]:
        for line in path.read_text().splitlines():
            m = re.search(r"#\s*(apiary: [^\n]+)$", line)
            if m and not line.lstrip().startswith("#"):
                markers.add(m.group(1).strip())
    assert len(markers) >= 10
    for marker in markers:
        assert f"`# {marker}`" in readme, f"README does not document the rewritten line `# {marker}`"
    for name, rule in _alerts().items():
        assert f"| {name} | {rule['labels']['severity']} |" in readme, f"README's alert table lacks {name}"
