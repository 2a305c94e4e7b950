"""``apiary aiops``: failure prediction and anomaly detection on the live platform.

* ``apiary aiops train [--runs 24] [--out FILE]``: fit the failure model on seeded fault-injection
  drill runs (:func:`apiary.aiops.train`; the same generator ``make bench`` evaluates on held-out
  seeds) and save it (pickle; default ``home/aiops-model.pkl``).
* ``apiary aiops watch [--prometheus URL] [--interval 300] [--model FILE] [--once]``: every drill
  interval, read one frame from Prometheus, judge it (:class:`apiary.aiops.Predictor`) and post each
  finding to ``POST /api/v2/incidents/events`` as a Sev4 event with its evidence; a prediction
  opens (or joins) a Sev4 incident. Detectors are switched off per rule in the detectors config.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import typer

from apiary.cli.common import api_client, fail
from apiary.errors import ApiaryError, UnavailableError
from apiary.procutil import write_private

aiops_app = typer.Typer(no_args_is_help=True, help="AIOps: failure prediction and anomaly detection.")


def _default_model() -> Path:
    from apiary.settings import Settings

    return Settings().home_dir / "aiops-model.pkl"


@aiops_app.command("train")
def train_command(runs: int = typer.Option(24, "--runs", min=2, max=500, help="Training runs (seeds 0..N-1)."),
                  out: Path | None = typer.Option(None, "--out", help="Where to save the model.")) -> None:
    """Fit the failure model on seeded drill runs and save it."""
    from apiary.aiops import generate_run, train

    model = train([generate_run(seed) for seed in range(runs)])
    path = out or _default_model()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, pickle.dumps(model))  # loading a pickle runs code: only its owner may write it
    print(path)


@aiops_app.command("watch")
def watch_command(prometheus: str = typer.Option(..., "--prometheus", envvar="APIARY_PROMETHEUS_URL"),
                  interval: float = typer.Option(300.0, "--interval", min=1.0, help="Seconds between scans."),
                  model: Path | None = typer.Option(None, "--model", help="A model saved by apiary aiops train."),
                  once: bool = typer.Option(False, "--once", help="One scan, then exit.")) -> None:
    """Scan Prometheus every interval and post the findings as Sev4 incident events."""
    from apiary.aiops import Predictor, PrometheusSource, scan_once

    path = model or _default_model()
    fitted = pickle.loads(path.read_bytes()) if path.exists() else None  # noqa: S301 - our own file
    if fitted is None:
        print(f"no model at {path}: anomaly detection only (run `apiary aiops train`)")
    predictor, source, client = Predictor(model=fitted), PrometheusSource(prometheus), api_client()

    def post(event: dict) -> object:
        return client._call("POST", "/api/v2/incidents/events", json=event).json()

    while True:
        try:
            findings = scan_once(source, predictor, post)
            print(f"{time.strftime('%H:%M:%S')} findings={len(findings)}", flush=True)
        except UnavailableError as e:
            print(f"scan failed: {e.message}", flush=True)
        except ApiaryError as e:
            fail(e)
        if once:
            return
        time.sleep(interval)
