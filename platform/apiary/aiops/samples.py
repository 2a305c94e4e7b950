"""What AIOps sees: one :class:`Frame` per observation, assembled from exported metric series.

Both roads into AIOps end in :func:`assemble`: the drill-run generator renders the platform's own
collectors and parses the text exposition (:func:`parse_exposition`), the live source asks
Prometheus for the same series (:mod:`apiary.aiops.live`). Either way a row is ``(metric name,
labels, value)`` with the names and labels the platform exports (``METRICS.md`` beside
:mod:`apiary.monitoring`):

=====================================  ============================================================
series                                 becomes
=====================================  ============================================================
``DCGM_FI_DEV_GPU_TEMP``               :attr:`GpuReading.temp_c` (Celsius)
``DCGM_FI_DEV_ECC_SBE_VOL_TOTAL``      :attr:`GpuReading.sbe_total` (volatile single-bit ECC count)
``DCGM_FI_DEV_XID_ERRORS``             :attr:`GpuReading.xid_last` (code of the last XID)
``apiary_gpu_xid_errors_total``        :attr:`GpuReading.xid_events` (XIDs since exporter start)
``DCGM_FI_DEV_GPU_UTIL``               :attr:`GpuReading.util_pct` (percent)
``apiary_task_gpu_utilization_ratio``  :class:`JobSample` (mean over the job's GPUs, as percent)
``apiary_job_waiting_seconds``         :attr:`Frame.vc_delay_s` (longest wait per VC, seconds)
=====================================  ============================================================
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TEMP = "DCGM_FI_DEV_GPU_TEMP"
SBE = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
XID_LAST = "DCGM_FI_DEV_XID_ERRORS"
XID_EVENTS = "apiary_gpu_xid_errors_total"
UTIL = "DCGM_FI_DEV_GPU_UTIL"
TASK_UTIL = "apiary_task_gpu_utilization_ratio"
WAITING = "apiary_job_waiting_seconds"
#: Every series :func:`assemble` reads, in the order above.
SERIES: tuple[str, ...] = (TEMP, SBE, XID_LAST, XID_EVENTS, UTIL, TASK_UTIL, WAITING)

Row = tuple[str, Mapping[str, str], float]

_GPU_FIELDS = {TEMP: "temp_c", SBE: "sbe_total", XID_LAST: "xid_last", XID_EVENTS: "xid_events", UTIL: "util_pct"}
# name{label="value",...} value [timestamp]; label values may hold escaped quotes (exposition format 0.0.4).
_LINE = re.compile(r'^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class GpuReading:
    """One GPU of one node at one observation. ``None``: the series was absent."""

    index: int
    temp_c: float | None = None
    sbe_total: float | None = None
    xid_last: float | None = None
    xid_events: float | None = None
    util_pct: float | None = None


@dataclass(frozen=True)
class NodeSample:
    """A node's GPUs at one observation, by GPU index (a GPU that fell off the bus is missing)."""

    node: str
    gpus: tuple[GpuReading, ...]


@dataclass(frozen=True)
class JobSample:
    """A running job's GPU utilisation (percent, mean over its GPUs) on one node."""

    job: str
    virtual_cluster: str
    node: str
    util_pct: float


@dataclass(frozen=True)
class Frame:
    """Everything observed at ``t`` (seconds; the drill run's clock or unix time when live)."""

    t: float
    nodes: dict[str, NodeSample] = field(default_factory=dict)
    jobs: tuple[JobSample, ...] = ()
    vc_delay_s: dict[str, float] = field(default_factory=dict)


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def parse_exposition(text: str, names: Iterable[str] = SERIES) -> list[Row]:
    """The samples of ``names`` in a Prometheus text exposition, as rows. Comments, other series and
    lines that do not parse are skipped (a scrape never fails over one odd line); a value that is not
    a float (``NaN`` is one) is skipped too."""
    wanted = tuple(names)
    rows: list[Row] = []
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        m = _LINE.match(line)
        if m is None or m["name"] not in wanted:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m["labels"] or "")}
        rows.append((m["name"], labels, value))
    return rows


def assemble(t: float, rows: Iterable[Row]) -> Frame:
    """One :class:`Frame` from rows of :data:`SERIES` (other names are ignored). GPU series are keyed
    by their ``Hostname`` and ``gpu`` labels (dcgm-exporter's); a row without them is ignored."""
    gpus: dict[str, dict[int, dict[str, float]]] = {}
    job_util: dict[tuple[str, str, str], list[float]] = {}
    delay: dict[str, float] = {}
    for name, labels, value in rows:
        if name in _GPU_FIELDS:
            host, gpu = labels.get("Hostname"), labels.get("gpu")
            if not host or gpu is None or not gpu.isdigit():
                continue
            gpus.setdefault(host, {}).setdefault(int(gpu), {})[_GPU_FIELDS[name]] = value
        elif name == TASK_UTIL:
            key = (labels.get("job", ""), labels.get("virtual_cluster", ""), labels.get("Hostname", ""))
            job_util.setdefault(key, []).append(value * 100.0)
        elif name == WAITING:
            vc = labels.get("virtual_cluster", "")
            delay[vc] = max(delay.get(vc, 0.0), value)
    nodes = {
        host: NodeSample(host, tuple(GpuReading(index=i, **by_gpu[i]) for i in sorted(by_gpu)))
        for host, by_gpu in sorted(gpus.items())
    }
    jobs = tuple(
        JobSample(job, vc, host, sum(vals) / len(vals)) for (job, vc, host), vals in sorted(job_util.items())
    )
    return Frame(t=t, nodes=nodes, jobs=jobs, vc_delay_s=delay)
