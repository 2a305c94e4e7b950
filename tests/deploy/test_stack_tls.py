"""The monitoring stack's configs for a platform on many hosts: the control plane's replicas scraped
over HTTPS and the webhook's certificate verified against the platform CA, as Prometheus and
Alertmanager themselves check them (``promtool check config``, ``amtool check-config``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from apiary.monitoring import stack


def _ca(tmp_path: Path) -> Path:
    ca = tmp_path / "ca.crt"
    ca.write_text("not parsed by the config checks\n")
    return ca


def test_prometheus_scrapes_every_replica_over_https_verified_by_the_ca(tmp_path: Path, promtool: str) -> None:
    ca = _ca(tmp_path)
    out = stack.render_prometheus(tmp_path / "prom", control_plane=["cp1:8470", "cp2:8470"],
                                  alertmanager="mon:9093", interval_s=1, ca_file=ca, nodes_https=True)
    cfg = yaml.safe_load(out.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    cp = jobs["apiary-control-plane"]
    assert cp["static_configs"][0]["targets"] == ["cp1:8470", "cp2:8470"]
    assert cp["scheme"] == "https" and cp["tls_config"] == {"ca_file": str(ca)}
    assert jobs["apiary-node"]["scheme"] == "https"
    r = subprocess.run([promtool, "check", "config", "--syntax-only", str(out)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_without_a_ca_the_shipped_plain_http_scrape_is_kept(tmp_path: Path) -> None:
    out = stack.render_prometheus(tmp_path / "prom", control_plane="127.0.0.1:8470", alertmanager="127.0.0.1:9093",
                                  interval_s=1)
    jobs = {j["job_name"]: j for j in yaml.safe_load(out.read_text())["scrape_configs"]}
    assert "scheme" not in jobs["apiary-control-plane"] and "tls_config" not in jobs["apiary-node"]
    assert jobs["apiary-control-plane"]["static_configs"][0]["targets"] == ["127.0.0.1:8470"]


def test_alertmanager_verifies_the_webhook_against_the_ca(tmp_path: Path, amtool: str) -> None:
    ca = _ca(tmp_path)
    token = tmp_path / "am.token"
    token.write_text("x\n")
    out = stack.render_alertmanager(tmp_path / "am", webhook_url="https://cp:8470/api/v2/alerts/webhook",
                                    smtp_smarthost="mail:25", token_file=token, ca_file=ca)
    hooks = [h for r in yaml.safe_load(out.read_text())["receivers"] for h in r.get("webhook_configs", [])]
    assert hooks and all(h["http_config"]["tls_config"] == {"ca_file": str(ca)} for h in hooks)
    assert all(h["url"].startswith("https://cp:8470/") for h in hooks)
    r = subprocess.run([amtool, "check-config", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_listen_address_is_the_host_given() -> None:
    assert "--web.listen-address=198.18.0.5:9090" in stack.prometheus_argv("p", Path("c"), Path("d"), 9090,
                                                                          host="198.18.0.5")
    assert "--web.listen-address=198.18.0.5:9093" in stack.alertmanager_argv("a", Path("c"), Path("d"), 9093,
                                                                            host="198.18.0.5")


def test_prometheus_and_alertmanager_serve_https_and_talk_over_it(tmp_path: Path, promtool: str) -> None:
    ca = _ca(tmp_path)
    cert, key = tmp_path / "mon.crt", tmp_path / "mon.key"
    web = stack.render_web_config(tmp_path / "web", cert, key)
    assert yaml.safe_load(web.read_text()) == {"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}}
    assert f"--web.config.file={web}" in stack.prometheus_argv("p", Path("c"), Path("d"), 9090, web_config=web)
    assert f"--web.config.file={web}" in stack.alertmanager_argv("a", Path("c"), Path("d"), 9093, web_config=web)
    out = stack.render_prometheus(tmp_path / "prom", control_plane="cp1:8470", alertmanager="mon:9093",
                                  interval_s=1, ca_file=ca, alertmanager_https=True)
    (am,) = yaml.safe_load(out.read_text())["alerting"]["alertmanagers"]
    assert am["scheme"] == "https" and am["tls_config"] == {"ca_file": str(ca)}
    r = subprocess.run([promtool, "check", "config", "--syntax-only", str(out)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
