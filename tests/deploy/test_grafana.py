"""deploy/grafana: dashboards and provisioning.

Every dashboard is valid JSON with a uid, a title and panels; every PromQL expression (panel
targets and variable queries) uses only metric names the exporters publish; every variable a
dashboard uses is defined in it; every expression parses (``promtool check rules`` over a rule
file made of them, variables substituted; skipped without promtool, failed under CI=true).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tests.deploy.promql import DCGM_METRICS, KNOWN_METRICS, label_values_metric, metric_names
from tests.deploy.tools import GRAFANA_DIR

DASHBOARDS = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))
BUILTIN_VARS = {
    "__interval", "__interval_ms", "__rate_interval", "__range", "__range_s", "__range_ms", "__from", "__to",
    "__dashboard", "__org", "__user", "__name", "__all", "timeFilter", "__timeFilter",
}
_VAR = re.compile(r"\$\{(\w+)(?:[:.][^}]*)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")
# What a variable stands for when an expression is parsed by promtool.
_SUBST = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _panels(dash: dict) -> Iterator[dict]:
    for p in dash.get("panels", []):
        yield p
        yield from p.get("panels", [])  # collapsed rows keep their panels inside


def _exprs(dash: dict) -> Iterator[tuple[str, str]]:
    for p in _panels(dash):
        for t in p.get("targets", []):
            if t.get("expr"):
                yield p.get("title", "?"), t["expr"]


def _var_queries(dash: dict) -> Iterator[tuple[str, str]]:
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            yield v["name"], q["query"] if isinstance(q, dict) else q


def _strings(obj) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def test_dashboards_exist() -> None:
    assert {p.stem for p in DASHBOARDS} == {"apiary-cluster", "apiary-node-gpu", "apiary-job", "incidents"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_shape(path: Path) -> None:
    dash = _load(path)
    assert dash["uid"] == path.stem and len(dash["uid"]) <= 40
    assert dash["title"].startswith("Apiary / ")
    panels = list(_panels(dash))
    assert [p for p in panels if p["type"] != "row"], "no panels"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in panels:
        assert p.get("title"), p
        gp = p["gridPos"]
        assert 0 <= gp["x"] and gp["x"] + gp["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p.get("targets"), f"panel {p['title']!r} has no query"
            assert p["datasource"] == {"type": "prometheus", "uid": "$datasource"}, p["title"]


def test_uids_and_titles_are_unique() -> None:
    dashes = [_load(p) for p in DASHBOARDS]
    assert len({d["uid"] for d in dashes}) == len(dashes)
    assert len({d["title"] for d in dashes}) == len(dashes)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_expressions_use_only_exported_metrics(path: Path) -> None:
    dash = _load(path)
    seen = set()
    found = [(f"panel {t!r}", e, metric_names(e)) for t, e in _exprs(dash)]
    found += [(f"variable {n}", q, label_values_metric(q)) for n, q in _var_queries(dash)]
    for where, expr, names in found:
        assert names, f"{path.name}: {where}: no metric found in {expr!r}"
        unknown = names - KNOWN_METRICS
        assert not unknown, f"{path.name}: {where}: unknown metrics {sorted(unknown)} in {expr!r}"
        seen |= names
    assert seen


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_variable_is_defined(path: Path) -> None:
    dash = _load(path)
    defined = {v["name"] for v in dash["templating"]["list"]}
    for s in _strings({k: v for k, v in dash.items() if k != "templating"}):
        for m in _VAR.finditer(s):
            name = next(g for g in m.groups() if g)
            assert name in defined or name in BUILTIN_VARS, f"{path.name}: ${name} is not defined (in {s!r})"
    # Variables may use earlier variables only (Grafana resolves them in order).
    order = [v["name"] for v in dash["templating"]["list"]]
    for i, v in enumerate(dash["templating"]["list"]):
        for s in _strings(v):
            for m in _VAR.finditer(s):
                name = next(g for g in m.groups() if g)
                assert name in BUILTIN_VARS or name in order[:i], f"{path.name}: variable {v['name']} uses ${name}"
    assert "datasource" in defined


def test_node_gpu_dashboard_matches_12239() -> None:
    """Grafana dashboard 12239 (NVIDIA DCGM Exporter) filters on $Hostname and $gpu; so does ours."""
    dash = _load(GRAFANA_DIR / "dashboards" / "apiary-node-gpu.json")
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"Hostname", "gpu", "datasource"} <= names
    dcgm_exprs = [e for _, e in _exprs(dash) if metric_names(e) & DCGM_METRICS]
    assert len(dcgm_exprs) >= 10
    for e in dcgm_exprs:
        assert 'Hostname=~"$Hostname"' in e or "on (Hostname, gpu)" in e, e
    used = set().union(*(metric_names(e) for e in dcgm_exprs))
    assert used == DCGM_METRICS, f"DCGM metrics without a panel: {sorted(DCGM_METRICS - used)}"


def test_job_dashboard_filters_on_job() -> None:
    dash = _load(GRAFANA_DIR / "dashboards" / "apiary-job.json")
    for where, expr in _exprs(dash):
        assert 'job="$job"' in expr, f"{where}: {expr!r}"


def test_cluster_dashboard_covers_vc_cells_jobs_and_queue() -> None:
    dash = _load(GRAFANA_DIR / "dashboards" / "apiary-cluster.json")
    used = set().union(*(metric_names(e) for _, e in _exprs(dash)))
    assert {"apiary_vc_cells", "apiary_jobs", "apiary_job_queue_length", "apiary_job_waiting_seconds"} <= used


def test_provisioning() -> None:
    ds = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "apiary.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http://")
    dp = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "apiary.yml").read_text())
    (provider,) = dp["providers"]
    assert provider["type"] == "file" and Path(provider["options"]["path"]).is_absolute()


def test_expressions_parse(promtool: str, tmp_path: Path) -> None:
    """promtool parses every dashboard expression (as a recording rule, variables substituted)."""
    rules = []
    for path in DASHBOARDS:
        dash = _load(path)
        exprs = [e for _, e in _exprs(dash)]
        label_values = re.compile(r"^\s*label_values\((.*),\s*\w+\s*\)\s*$", re.S)
        exprs += [label_values.sub(r"\1", q) for _, q in _var_queries(dash)]
        for i, e in enumerate(exprs):
            e = _VAR.sub(lambda m: _SUBST.get(next(g for g in m.groups() if g), "x"), e)
            rules.append({"record": f"grafana:{path.stem.replace('-', '_')}:{i}", "expr": e})
    f = tmp_path / "dashboards.rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
