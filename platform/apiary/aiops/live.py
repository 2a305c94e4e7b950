"""The live platform's side: the same series read from Prometheus, and one scan.

:class:`PrometheusSource` asks Prometheus's HTTP API (``GET /api/v1/query``, an instant query) for
every series in :data:`apiary.aiops.samples.SERIES` at once and assembles a :class:`Frame` with the
code the drill runs use. :func:`scan_once` feeds it to a :class:`Predictor` and posts each finding as
a PagerDuty Events API v2 event. Run it once per drill interval (a Prefect schedule, or a loop that
owns the clock); the predictor keeps its windows between scans, so one instance serves every scan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from apiary.aiops.findings import Finding, finding_to_event
from apiary.aiops.predictor import Predictor
from apiary.aiops.samples import SERIES, Frame, Row, assemble
from apiary.errors import UnavailableError

logger = logging.getLogger(__name__)

QUERY = "{__name__=~\"" + "|".join(SERIES) + "\"}"


class PrometheusSource:
    """Reads a :class:`Frame` from Prometheus at ``base_url`` (e.g. ``http://127.0.0.1:9090``).
    ``client``: an ``httpx.Client`` to use (tests inject one); blocking, ``timeout_s`` per request.
    Raises :class:`~apiary.errors.UnavailableError` when Prometheus cannot be reached or answers
    with an error (retry at the next scan)."""

    def __init__(self, base_url: str, *, client: httpx.Client | None = None, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time):
        self.base_url = base_url.rstrip("/")
        self._client = client or httpx.Client(timeout=timeout_s)
        self._clock = clock

    def query(self, promql: str, at: float | None = None) -> list[Row]:
        """An instant query's vector as rows ``(__name__, labels, value)``."""
        params: dict[str, Any] = {"query": promql}
        if at is not None:
            params["time"] = at
        try:
            r = self._client.get(f"{self.base_url}/api/v1/query", params=params)
            body = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise UnavailableError(f"Prometheus at {self.base_url}: {e}") from e
        if r.status_code != 200 or body.get("status") != "success":
            raise UnavailableError(f"Prometheus at {self.base_url} answered {r.status_code}: "
                                   f"{body.get('errorType', '')} {body.get('error', '')}".strip())
        data = body.get("data") or {}
        if data.get("resultType") != "vector":
            raise UnavailableError(f"Prometheus at {self.base_url}: expected a vector, got {data.get('resultType')}")
        rows: list[Row] = []
        for item in data.get("result") or ():
            labels = dict(item.get("metric") or {})
            try:
                value = float(item["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            rows.append((labels.pop("__name__", ""), labels, value))
        return rows

    def frame(self, at: float | None = None) -> Frame:
        """Every AIOps series at ``at`` (unix seconds; default now), one query."""
        t = self._clock() if at is None else at
        return assemble(t, self.query(QUERY, at=t))

    def close(self) -> None:
        self._client.close()


def scan_once(source: PrometheusSource, predictor: Predictor,
              post_event: Callable[[dict[str, Any]], object]) -> list[Finding]:
    """Read one frame, judge it, post a Sev4 event per finding; returns the findings. A failed post
    is logged and the others still go (the next finding of the same rule and subject carries the
    same dedup key). Raises UnavailableError when Prometheus cannot be read."""
    frame = source.frame()
    findings = predictor.observe_frame(frame)
    for f in findings:
        try:
            post_event(finding_to_event(f))
        except Exception as e:  # a notifier failing must not stop the scan
            logger.warning("aiops event not posted rule=%s subject=%s: %s", f.rule, f.subject, e)
    logger.info("aiops scan t=%s nodes=%d findings=%d", frame.t, len(frame.nodes), len(findings))
    return findings
