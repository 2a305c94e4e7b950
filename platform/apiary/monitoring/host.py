"""Host metrics through psutil: CPU, memory, disks and network of the node."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)

# Pseudo / read-only image file systems that are never worth a disk-full alert.
_SKIP_FSTYPES = frozenset({"squashfs", "iso9660", "tmpfs", "devtmpfs", "overlay", "proc", "sysfs", "nsfs"})


def _cpu_busy_idle(t: Any) -> tuple[float, float]:
    idle = t.idle + getattr(t, "iowait", 0.0)
    # guest time is already included in user/nice on Linux
    total = sum(getattr(t, f) for f in t._fields if f not in ("guest", "guest_nice"))
    return total - idle, idle


class HostCollector:
    """``apiary_host_*`` families for ``hostname``.

    CPU utilization is the busy share of all CPUs between two scrapes, computed from ``psutil.cpu_times()``
    deltas kept by this collector (so other ``psutil.cpu_percent`` users do not disturb it); the first
    scrape reports the average since boot. Disks: the mountpoints in ``mountpoints`` when given, else
    psutil's physical partitions (minus read-only image file systems) plus ``/``, one per device.
    Network: every interface but ``lo`` (``include_loopback`` to keep it).
    """

    def __init__(self, hostname: str, *, mountpoints: Sequence[str] | None = None, include_loopback: bool = False):
        self.hostname = hostname
        self.mountpoints = list(mountpoints) if mountpoints is not None else None
        self.include_loopback = include_loopback
        self._lock = threading.Lock()
        self._last_cpu: tuple[float, float] | None = None
        self._warned: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        return ()

    def _cpu_ratio(self) -> float:
        busy, idle = _cpu_busy_idle(psutil.cpu_times())
        with self._lock:
            last, self._last_cpu = self._last_cpu, (busy, idle)
        if last is not None:
            d_busy, d_idle = busy - last[0], idle - last[1]
            if d_busy + d_idle > 0:
                return max(0.0, min(1.0, d_busy / (d_busy + d_idle)))
        return busy / (busy + idle) if busy + idle > 0 else 0.0

    def _mounts(self) -> list[str]:
        if self.mountpoints is not None:
            return self.mountpoints
        out, devices = [], set()
        try:
            parts = psutil.disk_partitions(all=False)
        except Exception:
            parts = []
        for p in parts:
            if p.fstype in _SKIP_FSTYPES or p.mountpoint.startswith("/snap/") or p.device in devices:
                continue
            devices.add(p.device)
            out.append(p.mountpoint)
        if "/" not in out:
            out.insert(0, "/")
        return out

    def collect(self) -> Iterator[Metric]:
        host = self.hostname
        g = GaugeMetricFamily(
            "apiary_host_cpu_utilization_ratio", "Busy share of all CPUs since the last scrape (0-1).",
            labels=["Hostname"],
        )
        g.add_metric([host], self._cpu_ratio())
        yield g
        g = GaugeMetricFamily("apiary_host_cpu_count", "Logical CPUs.", labels=["Hostname"])
        g.add_metric([host], float(psutil.cpu_count() or 0))
        yield g

        vm = psutil.virtual_memory()
        used = vm.total - vm.available
        for name, help_, value in (
            ("apiary_host_memory_total_bytes", "Physical memory.", vm.total),
            ("apiary_host_memory_used_bytes", "Memory in use: total - available.", used),
            ("apiary_host_memory_available_bytes", "Memory available to new processes.", vm.available),
            ("apiary_host_memory_used_ratio", "Memory in use / total (0-1).", used / vm.total if vm.total else 0.0),
        ):
            g = GaugeMetricFamily(name, help_, labels=["Hostname"])
            g.add_metric([host], float(value))
            yield g

        ratio = GaugeMetricFamily(
            "apiary_host_disk_used_ratio", "Used share of the file system (0-1).", labels=["Hostname", "mountpoint"]
        )
        free = GaugeMetricFamily(
            "apiary_host_disk_free_bytes", "Bytes available to unprivileged users.", labels=["Hostname", "mountpoint"]
        )
        size = GaugeMetricFamily(
            "apiary_host_disk_size_bytes", "Size of the file system.", labels=["Hostname", "mountpoint"]
        )
        for mp in self._mounts():
            try:
                du = psutil.disk_usage(mp)
            except OSError as exc:
                if mp not in self._warned:
                    self._warned.add(mp)
                    logger.warning("disk usage of %s unavailable: %s", mp, exc)
                continue
            # psutil's percent is used / (used + free): the share a non-root user sees, like df
            ratio.add_metric([host, mp], du.percent / 100.0)
            free.add_metric([host, mp], float(du.free))
            size.add_metric([host, mp], float(du.total))
        yield ratio
        yield free
        yield size

        rx = CounterMetricFamily(
            "apiary_host_network_receive_bytes", "Bytes received by the interface.", labels=["Hostname", "device"]
        )
        tx = CounterMetricFamily(
            "apiary_host_network_transmit_bytes", "Bytes sent by the interface.", labels=["Hostname", "device"]
        )
        for nic, c in sorted(psutil.net_io_counters(pernic=True).items()):
            if nic == "lo" and not self.include_loopback:
                continue
            rx.add_metric([host, nic], float(c.bytes_recv))
            tx.add_metric([host, nic], float(c.bytes_sent))
        yield rx
        yield tx
