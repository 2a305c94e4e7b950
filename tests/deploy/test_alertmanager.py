"""deploy/alertmanager/alertmanager.yml: ``amtool check-config`` and ``amtool config routes test``.

The routing cases prove who is notified for each severity (fatal and error: email and the
platform's webhook; warn and info: the webhook only). The inhibition rules are checked by reading
the file here; tests/deploy/test_monitoring_e2e.py proves a node-down alert actually suppresses
its node's other alerts in a running Alertmanager.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml
from tests.deploy.tools import ALERTMANAGER_DIR, PROMETHEUS_DIR

CONFIG = ALERTMANAGER_DIR / "alertmanager.yml"
WEBHOOK_URL = "http://127.0.0.1:8470/api/v2/alerts/webhook"


def _config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def _amtool(amtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([amtool, *args], capture_output=True, text=True, timeout=60)


def test_amtool_check_config(amtool: str) -> None:
    r = _amtool(amtool, "check-config", str(CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@pytest.mark.parametrize(
    ("labels", "receivers"),
    [
        (["alertname=ApiaryNodeDown", "severity=fatal", "node=worker-0"], "apiary-webhook,apiary-email"),
        (["alertname=ApiaryGpuEccDoubleBitError", "severity=fatal", "node=worker-0", "gpu=0"],
         "apiary-webhook,apiary-email"),
        (["alertname=SomeFutureFatal", "severity=fatal"], "apiary-webhook,apiary-email"),
        (["alertname=ApiaryGpuXidError", "severity=error", "node=worker-0", "gpu=3"], "apiary-webhook,apiary-email"),
        (["alertname=ApiaryControlPlaneDown", "severity=error", "job=apiary-control-plane"],
         "apiary-webhook,apiary-email"),
        (["alertname=ApiaryGpuTooHot", "severity=warn", "node=worker-0", "gpu=5"], "apiary-webhook"),
        (["alertname=ApiaryJobWaitingTooLong", "severity=info", "job=bert"], "apiary-webhook"),
        (["alertname=ApiaryJobLowGpuUtilization", "severity=info", "job=bert"], "apiary-webhook"),
        # Named routes: node-down pages even if its severity label were ever lowered.
        (["alertname=ApiaryNodeDown", "severity=warn", "node=worker-0"], "apiary-webhook,apiary-email"),
        (["alertname=Unlabelled"], "apiary-webhook"),
    ],
    ids=lambda v: v if isinstance(v, str) else "+".join(v),
)
def test_routes(amtool: str, labels: list[str], receivers: str) -> None:
    r = _amtool(amtool, "config", "routes", "test", f"--config.file={CONFIG}", f"--verify.receivers={receivers}",
                *labels)
    assert r.returncode == 0, f"{labels} -> {r.stdout.strip()!r}, expected {receivers!r}\n{r.stderr}"
    assert r.stdout.strip() == receivers


def test_every_rule_severity_is_routed(amtool: str) -> None:
    """Every severity the rules use reaches the webhook; fatal and error also reach email."""
    severities = set()
    for path in (PROMETHEUS_DIR / "rules").glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            severities |= {r["labels"]["severity"] for r in group["rules"] if "alert" in r}
    assert severities == {"info", "warn", "error", "fatal"}
    for sev in severities:
        want = "apiary-webhook,apiary-email" if sev in ("fatal", "error") else "apiary-webhook"
        r = _amtool(amtool, "config", "routes", "test", f"--config.file={CONFIG}", f"--verify.receivers={want}",
                    "alertname=X", f"severity={sev}")
        assert r.returncode == 0, f"severity={sev}: {r.stdout.strip()!r}, expected {want!r}"


def test_grouping() -> None:
    assert _config()["route"]["group_by"] == ["alertname", "node", "job"]


def test_node_down_inhibits_the_nodes_other_alerts() -> None:
    rules = _config()["inhibit_rules"]
    node_down = [r for r in rules if r.get("source_matchers") == ['alertname="ApiaryNodeDown"']]
    assert len(node_down) == 1, rules
    rule = node_down[0]
    assert rule["equal"] == ["node"]
    assert rule["target_matchers"] == ['alertname!="ApiaryNodeDown"']


def test_receivers() -> None:
    cfg = _config()
    receivers = {r["name"]: r for r in cfg["receivers"]}
    hook = receivers["apiary-webhook"]["webhook_configs"][0]
    assert hook["url"] == WEBHOOK_URL
    assert hook["send_resolved"] is True
    mail = receivers["apiary-email"]["email_configs"][0]
    assert mail["to"] and mail["send_resolved"] is True and mail["require_tls"] is False
    assert cfg["global"]["smtp_smarthost"] == "127.0.0.1:2525"
    assert cfg["global"]["smtp_require_tls"] is False
