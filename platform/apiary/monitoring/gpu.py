"""GPU metrics with dcgm-exporter's names and labels, from NVML or from a simulation.

:class:`GpuCollector` turns the :class:`GpuSample` list of a *source* into metric families:

* :class:`NvmlGpus` reads real GPUs through ``pynvml`` (the ``nvidia-ml-py`` distribution). XID
  errors come from an NVML event set registered for ``nvmlEventTypeXidCriticalError`` and drained
  without blocking (``nvmlEventSetWait(set, 0)``) on each scrape. Without a driver (``nvmlInit``
  raises, e.g. ``NVMLError_LibraryNotFound``) the source is *unavailable*: the collector then exports
  ``apiary_nvml_available 0`` and the reason in ``apiary_nvml_info``, logs it once, and retries
  ``nvmlInit`` at most every ``retry_s`` seconds -- it never raises into a scrape.
* :class:`SimulatedGpus` is a pure model for nodes without GPUs: values follow the tasks placed on
  each GPU (deterministic per task, with a seeded jitter that changes every ``period_s``) and faults
  can be injected like DCGM's error injection (:meth:`SimulatedGpus.inject` / :meth:`~SimulatedGpus.clear`).

Counter-typed dcgm-exporter fields (ECC volatile totals, PCIe replays) are exposed with their exact
sample names but as ``gauge``: prometheus_client would rename a ``counter`` family whose name does not
end in ``_total`` in its ``# TYPE`` line, and dashboards query the bare names. ``rate()`` and
``increase()`` work on them all the same.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from apiary.monitoring.gpu_health import (
    HEALTH_FIELDS,
    HealthFaults,
    check_health_faults,
    read_nvml_health,
    simulated_health,
)

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
DCGM_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")

# (attribute of GpuSample, metric name, help) in exposition order.
DCGM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("util", "DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
    ("fb_used_mib", "DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
    ("fb_free_mib", "DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."),
    ("temp_c", "DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."),
    ("power_w", "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
    ("sm_clock_mhz", "DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
    ("mem_clock_mhz", "DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz)."),
    ("ecc_sbe_vol", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors."),
    ("ecc_dbe_vol", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors."),
    ("xid_last", "DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered."),
    ("pcie_replay", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries."),
    *HEALTH_FIELDS,  # row remapping, retired pages, throttle reasons, PCIe link (apiary.monitoring.gpu_health)
)


@dataclass
class GpuSample:
    """One GPU at one instant. ``None`` means "not supported / could not be read" (the sample is omitted)."""

    index: int
    uuid: str
    name: str
    device: str
    pci_bus_id: str = ""
    util: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    ecc_sbe_vol: float | None = None
    ecc_dbe_vol: float | None = None
    xid_last: float | None = 0
    pcie_replay: float | None = None
    xid_events: int = 0
    # Health beyond ECC/XID (apiary.monitoring.gpu_health.HEALTH_FIELDS): counts, 0/1 flags, a bitmask,
    # PCIe generation and lanes.
    remapped_rows_corr: float | None = None
    remapped_rows_unc: float | None = None
    row_remap_pending: float | None = None
    row_remap_failure: float | None = None
    retired_sbe: float | None = None
    retired_dbe: float | None = None
    retired_pending: float | None = None
    throttle_reasons: float | None = None
    pcie_link_gen: float | None = None
    pcie_link_width: float | None = None
    pcie_max_link_gen: float | None = None
    pcie_max_link_width: float | None = None
    # pids of the compute processes on the GPU; None when unknown.
    process_pids: tuple[int, ...] | None = None


class GpuSource(Protocol):
    kind: str

    def status(self) -> tuple[bool, str, str]:
        """``(available, reason, driver_version)``; ``reason`` is empty when available."""
        ...

    def samples(self) -> list[GpuSample]: ...


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# --------------------------------------------------------------------------------------------- NVML


class NvmlGpus:
    """Real GPUs through NVML. ``nvml`` is the ``pynvml`` module (imported lazily) or a stand-in with
    the same functions and constants -- tests inject a fake one. Thread-safe; one instance per process.
    """

    kind = "nvml"

    def __init__(self, nvml: Any = None, *, retry_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self._nv = nvml
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._ready = False
        self._reason = "not initialized"
        self._logged_reason: str | None = None
        self._next_try = float("-inf")
        self._driver = ""
        self._events: Any = None
        self._xid_last: dict[str, int] = {}  # by UUID: indexes may shift when a GPU falls off the bus
        self._xid_count: dict[str, int] = {}
        self._warned: set[tuple] = set()

    # -- lifecycle
    def _module(self) -> Any:
        if self._nv is None:
            import pynvml  # the nvidia-ml-py distribution

            self._nv = pynvml
        return self._nv

    def _ensure(self) -> bool:
        if self._ready:
            return True
        now = self._clock()
        if now < self._next_try:
            return False
        self._next_try = now + self.retry_s
        try:
            nv = self._module()
            nv.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            self._unavailable(f"{type(exc).__name__}: {exc}")
            return False
        self._ready = True
        self._reason = ""
        if self._logged_reason is not None:
            logger.info("NVML available again")
        self._logged_reason = None
        try:
            self._driver = _text(nv.nvmlSystemGetDriverVersion())
        except Exception:
            self._driver = ""
        self._register_events(nv)
        return True

    def _unavailable(self, reason: str) -> None:
        self._ready = False
        self._reason = reason
        if reason != self._logged_reason:
            logger.warning("NVML unavailable, no GPU metrics from this node: %s", reason)
            self._logged_reason = reason

    def _register_events(self, nv: Any) -> None:
        self._events = None
        try:
            events = nv.nvmlEventSetCreate()
        except Exception as exc:
            self._warn_once(("eventset",), "NVML event set unavailable, no XID errors: %s", exc)
            return
        self._events = events
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(i), nv.nvmlEventTypeXidCriticalError, events)
            except Exception as exc:  # NotSupported on some boards, NoPermission without root
                self._warn_once(("xid", i), "GPU %s: cannot register for XID events: %s", i, exc)

    def close(self) -> None:
        with self._lock:
            if not self._ready:
                return
            nv = self._nv
            try:
                if self._events is not None:
                    nv.nvmlEventSetFree(self._events)
                nv.nvmlShutdown()
            except Exception:
                pass
            self._ready = False
            self._events = None
            self._reason = "closed"

    def _warn_once(self, key: tuple, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    # -- reading
    def status(self) -> tuple[bool, str, str]:
        with self._lock:
            self._ensure()
            return self._ready, self._reason, self._driver

    def _drain_xid(self, nv: Any) -> None:
        if self._events is None:
            return
        for _ in range(10_000):  # bounded: a storm of events must not stall a scrape
            try:
                data = nv.nvmlEventSetWait(self._events, 0)  # timeout 0: never blocks
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
                    self._warn_once(("eventwait",), "nvmlEventSetWait failed: %s", exc)
                return
            if not int(data.eventType) & int(nv.nvmlEventTypeXidCriticalError):
                continue
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(data.device))
            except Exception:
                continue
            self._xid_last[uuid] = int(data.eventData)
            self._xid_count[uuid] = self._xid_count.get(uuid, 0) + 1
            logger.warning("GPU %s: XID %s", uuid, int(data.eventData))

    def _read(self, nv: Any, index: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) != nv.NVML_ERROR_NOT_SUPPORTED:
                self._warn_once((what, index), "GPU %s: cannot read %s: %s", index, what, exc)
            return None

    def samples(self) -> list[GpuSample]:
        with self._lock:
            if not self._ensure():
                return []
            nv = self._nv
            try:
                count = nv.nvmlDeviceGetCount()
            except Exception as exc:  # driver unloaded under us: report unavailable, re-init later
                self._unavailable(f"{type(exc).__name__}: {exc}")
                try:
                    nv.nvmlShutdown()
                except Exception:
                    pass
                return []
            self._drain_xid(nv)
            out = []
            for i in range(count):
                try:
                    h = nv.nvmlDeviceGetHandleByIndex(i)
                    uuid = _text(nv.nvmlDeviceGetUUID(h))
                except nv.NVMLError as exc:  # e.g. GpuIsLost: not visible any more
                    self._warn_once(("handle", i), "GPU %s not accessible: %s", i, exc)
                    continue
                out.append(self._sample(nv, i, h, uuid))
            return out

    def _sample(self, nv: Any, i: int, h: Any, uuid: str) -> GpuSample:
        r = self._read
        name = r(nv, i, "name", nv.nvmlDeviceGetName, h)
        minor = r(nv, i, "minor number", nv.nvmlDeviceGetMinorNumber, h)
        pci = r(nv, i, "PCI info", nv.nvmlDeviceGetPciInfo, h)
        s = GpuSample(
            index=i,
            uuid=uuid,
            name=_text(name) if name is not None else "",
            device=f"nvidia{minor if minor is not None else i}",
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            xid_last=self._xid_last.get(uuid, 0),
            xid_events=self._xid_count.get(uuid, 0),
        )
        util = r(nv, i, "utilization", nv.nvmlDeviceGetUtilizationRates, h)
        s.util = float(util.gpu) if util is not None else None
        mem = r(nv, i, "memory", nv.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            s.fb_used_mib = float(mem.used // MIB)
            s.fb_free_mib = float(mem.free // MIB)
        s.temp_c = r(nv, i, "temperature", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        mw = r(nv, i, "power", nv.nvmlDeviceGetPowerUsage, h)
        s.power_w = mw / 1000.0 if mw is not None else None
        s.sm_clock_mhz = r(nv, i, "SM clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        s.mem_clock_mhz = r(nv, i, "memory clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        ecc = nv.nvmlDeviceGetTotalEccErrors
        s.ecc_sbe_vol = r(nv, i, "ECC SBE", ecc, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
        s.ecc_dbe_vol = r(nv, i, "ECC DBE", ecc, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        s.pcie_replay = r(nv, i, "PCIe replays", nv.nvmlDeviceGetPcieReplayCounter, h)
        for attr, v in read_nvml_health(nv, lambda what, fn, *args: r(nv, i, what, fn, *args), h).items():
            setattr(s, attr, v)
        procs = r(nv, i, "compute processes", nv.nvmlDeviceGetComputeRunningProcesses, h)
        s.process_pids = tuple(int(p.pid) for p in procs) if procs is not None else None
        return s


@dataclass(frozen=True)
class NvmlProbe:
    """What NVML answers on this host, once: the ``names`` of its GPUs (index order) and the
    ``driver`` version, or the ``reason`` it does not answer (no driver, no GPU)."""

    names: tuple[str, ...] = ()
    driver: str = ""
    reason: str = ""

    @property
    def answers(self) -> bool:
        """NVML initialised and sees at least one GPU."""
        return not self.reason

    @property
    def count(self) -> int:
        return len(self.names)


def probe_nvml(nvml: Any = None) -> NvmlProbe:
    """Ask NVML (``nvml``: the ``pynvml`` module, imported here when None, or a stand-in) how many
    GPUs this host has: ``nvmlInit``, the count and names, ``nvmlShutdown``. Never raises: an
    ImportError, a missing driver (``NVMLError_LibraryNotFound``, ``NVMLError_DriverNotLoaded``) or
    no GPU is a probe that does not answer, with the reason."""
    try:
        if nvml is None:
            import pynvml  # the nvidia-ml-py distribution

            nvml = pynvml
        nvml.nvmlInit()
    except Exception as exc:  # any failure means: no NVML here
        return NvmlProbe(reason=f"{type(exc).__name__}: {exc}")
    try:
        count = int(nvml.nvmlDeviceGetCount())
        names = tuple(_text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count))
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:  # the version is for the start line only
            driver = ""
    except Exception as exc:
        return NvmlProbe(reason=f"{type(exc).__name__}: {exc}")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # nothing to undo
            pass
    if not names:
        return NvmlProbe(driver=driver, reason="NVML answers but sees no GPU")
    return NvmlProbe(names=names, driver=driver)


# ---------------------------------------------------------------------------------------- simulated


def _unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from ``parts`` (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass
class _Faults:
    temp: float | None = None
    xid_last: int = 0
    xid_events: int = 0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    pcie_replay: int = 0
    foreign: int = 0
    lost: bool = False
    degraded: float = 1.0  # simulated slowdown factor (1 = healthy)
    health: HealthFaults = field(default_factory=HealthFaults)

    def copy(self) -> _Faults:
        return _Faults(**{**vars(self), "health": HealthFaults(**vars(self.health))})

    def active(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.temp is not None:
            out["temp"] = self.temp
        if self.xid_last:
            out["xid"] = self.xid_last
        for k in ("ecc_sbe", "ecc_dbe", "pcie_replay", "foreign"):
            if getattr(self, k):
                out[k] = getattr(self, k)
        if self.lost:
            out["lost"] = True
        if self.degraded != 1.0:
            out["degraded"] = self.degraded
        return out | self.health.active()


@dataclass
class SimulatedGpuSpec:
    """Hardware constants of a simulated GPU (A100-80GB-like by default; :data:`H100_SPEC` for Hopper).

    ``pcie_max_gen`` / ``pcie_max_width``: the link a healthy board trains to. ``row_remapping``: the
    GPU remaps rows (Ampere and newer); ``page_retirement``: it retires pages (before Ampere; real
    A100s answer NOT_SUPPORTED). The A100-like default keeps both so that every fault kind can be
    drilled on the default simulated nodes.
    """

    model_name: str = "Simulated GPU"
    memory_mib: int = 81920
    idle_power_w: float = 55.0
    max_power_w: float = 400.0
    idle_sm_clock_mhz: int = 210
    max_sm_clock_mhz: int = 1410
    mem_clock_mhz: int = 1593
    idle_temp_c: tuple[float, float] = (30.0, 35.0)
    temp_per_util_c: float = 0.5  # +50 C at 100 %
    util_range: tuple[float, float] = (60.0, 95.0)
    jitter_pct: float = 3.0
    pcie_max_gen: int = 4
    pcie_max_width: int = 16
    row_remapping: bool = True
    page_retirement: bool = True


#: An H100/H200-SXM-like SKU: PCIe gen 5 x16, row remapping only (Hopper retires no pages).
H100_SPEC = SimulatedGpuSpec(
    model_name="Simulated H100", idle_power_w=70.0, max_power_w=700.0, max_sm_clock_mhz=1980, mem_clock_mhz=2619,
    pcie_max_gen=5, page_retirement=False,
)

FOREIGN_PID_BASE = 1 << 23  # above Linux's pid_max (4194304): never a real platform pid


@dataclass
class _Placement:
    key: str
    pid: int | None = None
    gpus: list[int] = field(default_factory=list)


class SimulatedGpus:
    """Simulated GPUs of node ``node``. Values are a pure function of (tasks placed, faults, clock()).

    ``tasks`` returns the node's running tasks as dicts with at least ``gpus`` (list of GPU indexes)
    and identifying keys (``job``, ``task_role``, ``index``; ``pid`` is reported as the GPU's compute
    process). A busy GPU's utilization is 60-95 % fixed per task plus a +-3 % jitter seeded by
    (task, GPU, ``clock() // period_s``); FB used is proportional to the task's base utilization,
    temperature and power rise linearly with utilization. Idle GPUs: 0 %, 30-35 C (fixed per GPU).
    """

    kind = "simulated"

    def __init__(
        self,
        node: str,
        count: int,
        *,
        tasks: Callable[[], Iterable[Mapping[str, Any]]] | None = None,
        clock: Callable[[], float] = time.time,
        period_s: float = 5.0,
        seed: int | str = 0,
        spec: SimulatedGpuSpec | None = None,
    ):
        self.node = node
        self.count = count
        self._tasks = tasks or (lambda: ())
        self._clock = clock
        self.period_s = period_s
        self.seed = seed
        self.spec = spec or SimulatedGpuSpec()
        self._lock = threading.Lock()
        self._faults: dict[int, _Faults] = {}

    def status(self) -> tuple[bool, str, str]:
        return True, "", "simulated"

    def uuid(self, gpu: int) -> str:
        return f"GPU-SIM-{self.node}-{gpu}"

    # -- fault injection (like dcgmi test --inject)
    def inject(
        self,
        gpu: int,
        *,
        ecc_dbe: int | None = None,
        ecc_sbe: int | None = None,
        xid: int | None = None,
        temp: float | None = None,
        pcie_replay: int | None = None,
        foreign: int | None = None,
        lost: bool | None = None,
        degraded: float | None = None,
        row_remap_failure: bool | None = None,
        row_remap_pending: bool | None = None,
        retired_pages: int | None = None,
        throttle: str | None = None,
        pcie_gen: int | None = None,
        pcie_width: int | None = None,
    ) -> dict[str, Any]:
        """Inject faults on GPU ``gpu``; returns the GPU's active faults.

        ``ecc_dbe``/``ecc_sbe``/``pcie_replay`` add N to the volatile counter; ``xid`` sets the last XID
        (and counts one XID event); ``temp`` overrides the temperature until cleared; ``foreign`` runs
        N processes that are not platform tasks on the GPU; ``lost`` makes the GPU invisible (fallen off
        the bus: the node's GPU count drops); ``degraded`` (a factor >= 1, 1 = healthy) throttles the
        GPU: its busy SM clock is divided by the factor (the node agent also slows the tasks on it
        down, see ``apiary.runtime.agent``).

        Health (:mod:`apiary.monitoring.gpu_health`): ``row_remap_failure`` / ``row_remap_pending``
        set the row-remapper flags; ``retired_pages`` adds N pages retired for double-bit errors
        (pending until cleared); ``throttle`` (``thermal``, ``power``, ``hw_slowdown``) sets that clock
        throttle reason; ``pcie_gen`` / ``pcie_width`` train the link below the SKU's maximum. Raises
        ValueError naming the kind for a value the SKU cannot report (see
        :func:`~apiary.monitoring.gpu_health.check_health_faults`).
        """
        if not 0 <= gpu < self.count:
            raise ValueError(f"no GPU {gpu} on {self.node} (has {self.count})")
        for name, n in (("ecc_dbe", ecc_dbe), ("ecc_sbe", ecc_sbe), ("pcie_replay", pcie_replay), ("foreign", foreign)):
            if n is not None and n < 0:
                raise ValueError(f"{name} must be >= 0")
        if degraded is not None and not 1.0 <= float(degraded) <= 1000.0:
            raise ValueError("degraded must be a factor in [1, 1000]")
        sp = self.spec
        check_health_faults(max_gen=sp.pcie_max_gen, max_width=sp.pcie_max_width, page_retirement=sp.page_retirement,
                            retired_pages=retired_pages, throttle=throttle, pcie_gen=pcie_gen, pcie_width=pcie_width)
        if not sp.row_remapping and (row_remap_failure or row_remap_pending):
            raise ValueError("row_remap_*: this GPU model retires pages instead of remapping rows")
        with self._lock:
            f = self._faults.setdefault(gpu, _Faults())
            if ecc_dbe:
                f.ecc_dbe += int(ecc_dbe)
            if ecc_sbe:
                f.ecc_sbe += int(ecc_sbe)
            if pcie_replay:
                f.pcie_replay += int(pcie_replay)
            if xid is not None:
                f.xid_last = int(xid)
                f.xid_events += 1
            if temp is not None:
                f.temp = float(temp)
            if foreign is not None:
                f.foreign = int(foreign)
            if lost is not None:
                f.lost = bool(lost)
            if degraded is not None:
                f.degraded = float(degraded)
            self._inject_health(f.health, row_remap_failure=row_remap_failure, row_remap_pending=row_remap_pending,
                                retired_pages=retired_pages, throttle=throttle, pcie_gen=pcie_gen,
                                pcie_width=pcie_width)
            return f.active()

    @staticmethod
    def _inject_health(h: HealthFaults, *, row_remap_failure: bool | None, row_remap_pending: bool | None,
                       retired_pages: int | None, throttle: str | None, pcie_gen: int | None,
                       pcie_width: int | None) -> None:
        """Apply the (already checked) health kinds given; None leaves a kind as it is."""
        if row_remap_failure is not None:
            h.row_remap_failure = bool(row_remap_failure)
        if row_remap_pending is not None:
            h.row_remap_pending = bool(row_remap_pending)
        if retired_pages:
            h.retired_pages += int(retired_pages)  # a counter, like the ECC ones
        if throttle is not None:
            h.throttle = throttle
        if pcie_gen is not None:
            h.pcie_gen = int(pcie_gen)
        if pcie_width is not None:
            h.pcie_width = int(pcie_width)

    def clear(self, gpu: int | None = None) -> None:
        """Clear every fault of ``gpu`` (all GPUs when None) -- like a GPU reset, which also zeroes the
        volatile ECC counters and the last XID."""
        with self._lock:
            if gpu is None:
                self._faults.clear()
            else:
                self._faults.pop(gpu, None)

    def faults(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return {g: f.active() for g, f in sorted(self._faults.items()) if f.active()}

    # -- model
    def _placements(self) -> dict[int, list[_Placement]]:
        by_gpu: dict[int, list[_Placement]] = {}
        for t in self._tasks():
            key = "/".join(str(t.get(k, "")) for k in ("job", "task_role", "index"))
            p = _Placement(key=key, pid=t.get("pid"), gpus=[int(g) for g in t.get("gpus") or ()])
            for g in p.gpus:
                if 0 <= g < self.count:
                    by_gpu.setdefault(g, []).append(p)
        return by_gpu

    def samples(self) -> list[GpuSample]:
        sp = self.spec
        now = self._clock()
        step = int(now // self.period_s) if self.period_s > 0 else 0
        placements = self._placements()
        with self._lock:
            faults = {g: f.copy() for g, f in self._faults.items()}
        out = []
        for g in range(self.count):
            f = faults.get(g) or _Faults()
            if f.lost:
                continue
            util = 0.0
            fb_frac = 0.0
            pids: list[int] = []
            for p in placements.get(g, ()):
                lo, hi = sp.util_range
                base = lo + (hi - lo) * _unit(self.seed, "util", p.key)
                jitter = (2 * _unit(self.seed, "jitter", p.key, g, step) - 1) * sp.jitter_pct
                util += min(hi, max(lo, base + jitter))
                fb_frac += 0.2 + 0.7 * (base / 100.0)
                if p.pid is not None:
                    pids.append(int(p.pid))
            util = round(min(100.0, util))
            fb_used = float(int(sp.memory_mib * min(0.98, fb_frac)))
            idle_lo, idle_hi = sp.idle_temp_c
            idle_temp = idle_lo + (idle_hi - idle_lo) * _unit(self.seed, "temp", self.node, g)
            temp = f.temp if f.temp is not None else float(round(idle_temp + sp.temp_per_util_c * util))
            power_jitter = (2 * _unit(self.seed, "power", self.node, g, step) - 1) * 2.0
            power = sp.idle_power_w + (sp.max_power_w - sp.idle_power_w) * util / 100.0 + power_jitter
            sm_clock = sp.idle_sm_clock_mhz if util == 0 else round(sp.max_sm_clock_mhz / f.degraded)
            pids += [FOREIGN_PID_BASE + k for k in range(f.foreign)]
            health = simulated_health(f.health, util=util, max_gen=sp.pcie_max_gen, max_width=sp.pcie_max_width,
                                      row_remapping=sp.row_remapping, page_retirement=sp.page_retirement)
            sample = GpuSample(
                index=g,
                uuid=self.uuid(g),
                name=sp.model_name,
                device=f"nvidia{g}",
                pci_bus_id=f"00000000:{0x18 + 0x10 * g:02X}:00.0",
                util=float(util),
                fb_used_mib=fb_used,
                fb_free_mib=float(sp.memory_mib) - fb_used,
                temp_c=temp,
                power_w=round(power, 3),
                sm_clock_mhz=float(sm_clock),
                mem_clock_mhz=float(sp.mem_clock_mhz),
                ecc_sbe_vol=float(f.ecc_sbe),
                ecc_dbe_vol=float(f.ecc_dbe),
                xid_last=float(f.xid_last),
                pcie_replay=float(f.pcie_replay),
                xid_events=f.xid_events,
                process_pids=tuple(pids),
            )
            for attr, v in health.items():
                setattr(sample, attr, v)
            out.append(sample)
        return out


# ---------------------------------------------------------------------------------------- collector


def _is_platform_pid(pid: int, ours: set[int]) -> bool:
    """``pid`` is in ``ours`` or descends from a process in it (a task may ``setsid`` a child)."""
    if pid in ours:
        return True
    if not ours:
        return False
    try:
        return any(p.pid in ours for p in psutil.Process(pid).parents())
    except psutil.Error:  # gone, or not in our pid namespace
        return False



class GpuCollector:
    """dcgm-exporter-compatible families for one node's GPUs, plus the node-level GPU health gauges.

    ``task_pids`` returns the pids of the platform's tasks on this node (see
    :func:`apiary.monitoring.tasks.platform_pids`); a GPU process that is neither one of them nor a
    descendant of one counts as foreign. It is only called when some GPU lists compute processes.
    ``expected`` is the GPU count the cluster config declares for the node.
    """

    def __init__(
        self,
        source: GpuSource,
        hostname: str,
        *,
        expected: int | None = None,
        task_pids: Callable[[], Iterable[int]] | None = None,
    ):
        self.source = source
        self.hostname = hostname
        self.expected = expected
        self._task_pids = task_pids
        self._last: tuple[float, list[GpuSample]] = (float("-inf"), [])

    def describe(self) -> Iterable[Metric]:
        return ()  # computed per scrape; skip registry name checks

    def latest(self, max_age_s: float = 5.0) -> list[GpuSample]:
        """The samples of the last scrape when younger than ``max_age_s``, else fresh ones (for the task
        collector, which runs right after this one in the same scrape)."""
        at, samples = self._last
        if time.monotonic() - at > max_age_s:
            samples = self.source.samples()
            self._last = (time.monotonic(), samples)
        return samples

    def utilization(self) -> dict[int, float]:
        """``{gpu index: utilization %}`` from :meth:`latest`."""
        return {s.index: s.util for s in self.latest() if s.util is not None}

    def collect(self) -> Iterator[Metric]:
        host = self.hostname
        available, reason, driver = self.source.status()
        samples = self.source.samples() if available else []
        self._last = (time.monotonic(), samples)
        simulated = self.source.kind == "simulated"

        g = GaugeMetricFamily("apiary_gpu_simulated", "1 when this node's GPUs are simulated.", labels=["Hostname"])
        g.add_metric([host], 1.0 if simulated else 0.0)
        yield g
        if not simulated:
            g = GaugeMetricFamily(
                "apiary_nvml_available", "1 when NVML initialized on this node, 0 otherwise.", labels=["Hostname"]
            )
            g.add_metric([host], 1.0 if available else 0.0)
            yield g
            info = InfoMetricFamily(
                "apiary_nvml", "NVML state: driver version, or why NVML is unavailable.",
                labels=["Hostname", "driver_version", "reason"],
            )
            info.add_metric([host, driver, reason], {})
            yield info

        g = GaugeMetricFamily("apiary_node_gpu_count", "GPUs visible on the node now.", labels=["Hostname"])
        g.add_metric([host], float(len(samples)))
        yield g
        if self.expected is not None:
            g = GaugeMetricFamily(
                "apiary_node_gpu_expected", "GPUs the cluster config declares for the node.", labels=["Hostname"]
            )
            g.add_metric([host], float(self.expected))
            yield g

        labels = {s.index: [str(s.index), s.uuid, s.pci_bus_id, s.device, s.name, host] for s in samples}
        for attr, name, help_ in DCGM_FIELDS:
            fam = GaugeMetricFamily(name, help_, labels=list(DCGM_LABELS))
            for s in samples:
                value = getattr(s, attr)
                if value is not None:
                    fam.add_metric(labels[s.index], float(value))
            yield fam

        xid = CounterMetricFamily(
            "apiary_gpu_xid_errors", "XID errors seen since the exporter started.", labels=list(DCGM_LABELS)
        )
        for s in samples:
            xid.add_metric(labels[s.index], float(s.xid_events))
        yield xid

        foreign = GaugeMetricFamily(
            "apiary_gpu_foreign_processes",
            "Compute processes on the GPU that are not the platform's tasks.",
            labels=["Hostname", "gpu"],
        )
        if any(s.process_pids for s in samples):
            ours = set(self._task_pids()) if self._task_pids is not None else set()
        else:
            ours = set()
        for s in samples:
            if s.process_pids is not None:
                n = sum(1 for p in s.process_pids if not _is_platform_pid(p, ours))
                foreign.add_metric([host, str(s.index)], float(n))
        yield foreign
