"""Prometheus and Alertmanager for ``apiary up --monitoring``: render the shipped configs and run
Debian's binaries on loopback.

The configs in ``deploy/prometheus`` and ``deploy/alertmanager`` are used as shipped; only the
values their ``# apiary:`` comments mark are changed (ports, addresses, intervals, file paths):
see ``deploy/prometheus/README.md``. Node targets go to a file_sd JSON file that Prometheus
re-reads, so node agents can come and go. What is written here is 0600 in 0700 directories, as
everything in the platform's home (:mod:`apiary.procutil`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from apiary.procutil import private_dir, write_private

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


@dataclass(frozen=True)
class Binaries:
    prometheus: str
    alertmanager: str


def find_binaries() -> Binaries | None:
    """Debian's ``prometheus`` and ``prometheus-alertmanager`` (or upstream's ``alertmanager``) on
    PATH, or None when either is missing."""
    prom = shutil.which("prometheus")
    am = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    return Binaries(prom, am) if prom and am else None


def write_targets(path: Path, metrics_urls: dict[str, str]) -> None:
    """file_sd targets, one per node agent: ``[{"targets": ["host:port"], "labels": {"node": n}}]``.
    Written atomically (Prometheus may read it at any moment)."""
    items = []
    for node, url in sorted(metrics_urls.items()):
        hostport = url.split("://", 1)[-1].split("/", 1)[0]
        items.append({"targets": [hostport], "labels": {"node": node}})
    tmp = path.with_suffix(".tmp")
    write_private(tmp, json.dumps(items, indent=2))
    tmp.replace(path)


def render_prometheus(out_dir: Path, *, control_plane: str | list[str], alertmanager: str, interval_s: float,
                      src: Path = DEPLOY / "prometheus", ca_file: Path | None = None,
                      nodes_https: bool = False, alertmanager_https: bool = False) -> Path:
    """Write ``out_dir/prometheus.yml`` (rules referenced in ``src``) and an empty targets file.
    ``control_plane`` (one or several replicas) and ``alertmanager`` are ``host:port``. With
    ``ca_file`` (the platform CA, PEM) the control plane is scraped over HTTPS and its certificate
    verified against the CA (Prometheus' ``scheme: https`` + ``tls_config.ca_file``); the node
    agents too when ``nodes_https``, and Alertmanager when ``alertmanager_https``."""
    cfg = yaml.safe_load((src / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = f"{interval_s:g}s"
    cfg["rule_files"] = [str((src / f).resolve()) for f in cfg["rule_files"]]
    cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager]
    if ca_file is not None and alertmanager_https:
        cfg["alerting"]["alertmanagers"][0].update({"scheme": "https", "tls_config": {"ca_file": str(ca_file)}})
    targets = out_dir / "targets" / "nodes.json"
    private_dir(targets.parent)
    if not targets.exists():
        write_targets(targets, {})
    for job in cfg["scrape_configs"]:
        if job["job_name"] == "apiary-control-plane":
            job["static_configs"][0]["targets"] = [control_plane] if isinstance(control_plane, str) else control_plane
            if ca_file is not None:
                job["scheme"], job["tls_config"] = "https", {"ca_file": str(ca_file)}
        elif job["job_name"] == "apiary-node":
            job["file_sd_configs"][0]["files"] = [str(targets)]
            job["file_sd_configs"][0]["refresh_interval"] = f"{max(interval_s, 1):g}s"
            if ca_file is not None and nodes_https:
                job["scheme"], job["tls_config"] = "https", {"ca_file": str(ca_file)}
    out = out_dir / "prometheus.yml"
    write_private(out, yaml.safe_dump(cfg, sort_keys=False))
    return out


def render_alertmanager(out_dir: Path, *, webhook_url: str, smtp_smarthost: str, token_file: Path,
                        src: Path = DEPLOY / "alertmanager" / "alertmanager.yml", ca_file: Path | None = None) -> Path:
    """Write ``out_dir/alertmanager.yml`` pointing the webhook receiver at ``webhook_url`` with the
    bearer token in ``token_file`` (Apiary's Alertmanager service token) and email at
    ``smtp_smarthost`` (``host:port``). With ``ca_file`` the webhook's HTTPS certificate is verified
    against the platform CA (``http_config.tls_config.ca_file``)."""
    cfg = yaml.safe_load(src.read_text())
    cfg["global"]["smtp_smarthost"] = smtp_smarthost
    for receiver in cfg["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = webhook_url
            hook.setdefault("http_config", {}).setdefault("authorization", {"type": "Bearer"})
            hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
            if ca_file is not None:
                hook["http_config"]["tls_config"] = {"ca_file": str(ca_file)}
    private_dir(out_dir)
    out = out_dir / "alertmanager.yml"
    write_private(out, yaml.safe_dump(cfg, sort_keys=False))
    return out


def render_web_config(out_dir: Path, cert: Path, key: Path) -> Path:
    """Write ``out_dir/web-config.yml``: Prometheus' and Alertmanager's HTTPS listener
    (``--web.config.file``, exporter-toolkit's ``tls_server_config``: ``cert_file``, ``key_file``)."""
    private_dir(out_dir)
    out = out_dir / "web-config.yml"
    write_private(out, yaml.safe_dump({"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}}))
    return out


def prometheus_argv(binary: str, config: Path, data: Path, port: int, host: str = "127.0.0.1",
                    web_config: Path | None = None) -> list[str]:
    # resend-delay 1s: Alertmanager hears a firing alert within a second of each evaluation.
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
            f"--web.listen-address={host}:{port}", "--rules.alert.resend-delay=1s", "--log.level=warn"]
    return argv + ([f"--web.config.file={web_config}"] if web_config else [])


def alertmanager_argv(binary: str, config: Path, data: Path, port: int, host: str = "127.0.0.1",
                      web_config: Path | None = None) -> list[str]:
    # No clustering (--cluster.listen-address=): one Alertmanager.
    argv = [binary, f"--config.file={config}", f"--storage.path={data}",
            f"--web.listen-address={host}:{port}", "--cluster.listen-address=", "--log.level=warn"]
    return argv + ([f"--web.config.file={web_config}"] if web_config else [])
