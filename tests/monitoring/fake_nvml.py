"""A fake NVML -- no GPU here: an object with the ``pynvml`` functions and constants the GPU collector
uses, backed by plain Python state, to inject as ``NvmlGpus(nvml=FakeNvml(...))``.

Only names that exist in the real ``pynvml`` are defined (``test_fake_names_exist_in_pynvml`` checks
it); test helpers (``fire_xid``, ``devices``, counters) have no ``nvml``/``NVML`` prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

MIB = 1024 * 1024


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            FakeNvml.NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            FakeNvml.NVML_ERROR_TIMEOUT: "Timeout",
            FakeNvml.NVML_ERROR_GPU_IS_LOST: "GPU is lost",
            FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        }.get(self.value, f"error {self.value}")


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's name
    def __init__(self) -> None:
        super().__init__(FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND)


@dataclass
class FakeGpu:
    name: str = "NVIDIA A100-SXM4-80GB"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    minor: int = 0
    bus_id: str = "00000000:07:00.0"
    util: int = 0
    mem_total: int = 81920 * MIB
    mem_used: int = 0
    temp: int = 30
    power_mw: int = 60_000
    sm_clock: int = 210
    mem_clock: int = 1593
    ecc_sbe: int | None = 0  # None: ECC not supported (raises NotSupported)
    ecc_dbe: int | None = 0
    pcie_replay: int = 0
    pids: list[int] = field(default_factory=list)
    lost: bool = False  # every per-device call raises GpuIsLost
    # Health beyond ECC/XID; None: NVML answers NotSupported for that call on this GPU.
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # (corr, unc, pending, failure)
    retired_pages: tuple[list[int], list[int]] | None = ([], [])  # (SBE, DBE) page addresses
    retired_pending: int | None = 0
    throttle_reasons: int | None = 0x1  # GPU idle
    pcie: tuple[int, int, int, int] | None = (4, 16, 4, 16)  # (gen, width, max gen, max width)


class FakeNvml:
    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    nvmlEventTypeXidCriticalError = 0x8
    NVMLError = NVMLError
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound

    def __init__(self, devices: list[FakeGpu], *, driver: str = "550.54.15", init_error: Exception | None = None):
        self.devices = devices
        self.driver = driver
        self.init_error = init_error
        self.initialized = False
        self.init_calls = 0
        self.registered: list[tuple[int, int]] = []  # (device index, event mask)
        self.pending: list[SimpleNamespace] = []
        self.wait_timeouts: list[int] = []

    # -- test helpers
    def fire_xid(self, index: int, code: int) -> None:
        self.pending.append(
            SimpleNamespace(device=index, eventType=self.nvmlEventTypeXidCriticalError, eventData=code)
        )

    def _dev(self, handle: int) -> FakeGpu:
        if not self.initialized:
            raise NVMLError(self.NVML_ERROR_UNINITIALIZED)
        d = self.devices[handle]
        if d.lost:
            raise NVMLError(self.NVML_ERROR_GPU_IS_LOST)
        return d

    # -- pynvml API (handles are device indexes)
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialized:
            raise NVMLError(self.NVML_ERROR_UNINITIALIZED)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not self.initialized:
            raise NVMLError(self.NVML_ERROR_UNINITIALIZED)
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._dev(handle).uuid

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._dev(handle).name

    def nvmlDeviceGetMinorNumber(self, handle: int) -> int:
        return self._dev(handle).minor

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._dev(handle).bus_id.encode())  # bytes, as older pynvml returns

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._dev(handle).util, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        d = self._dev(handle)
        return SimpleNamespace(total=d.mem_total, used=d.mem_used, free=d.mem_total - d.mem_used)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._dev(handle).temp

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self._dev(handle).power_mw

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> int:
        d = self._dev(handle)
        return {self.NVML_CLOCK_SM: d.sm_clock, self.NVML_CLOCK_MEM: d.mem_clock}[clock]

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        d = self._dev(handle)
        assert counter_type == self.NVML_VOLATILE_ECC
        value = d.ecc_sbe if error_type == self.NVML_MEMORY_ERROR_TYPE_CORRECTED else d.ecc_dbe
        if value is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetPcieReplayCounter(self, handle: int) -> int:
        return self._dev(handle).pcie_replay

    def _supported(self, value: Any) -> Any:
        if value is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return self._supported(self._dev(handle).remapped_rows)

    def nvmlDeviceGetRetiredPages(self, handle: int, source: int) -> list[int]:
        pages = self._supported(self._dev(handle).retired_pages)
        return list(pages[source])  # source: NVML_PAGE_RETIREMENT_CAUSE_* (0: SBE, 1: DBE)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return self._supported(self._dev(handle).retired_pending)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return self._supported(self._dev(handle).throttle_reasons)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: int) -> int:
        return self._supported(self._dev(handle).pcie)[0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: int) -> int:
        return self._supported(self._dev(handle).pcie)[1]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:
        return self._supported(self._dev(handle).pcie)[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:
        return self._supported(self._dev(handle).pcie)[3]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=p, usedGpuMemory=0) for p in self._dev(handle).pids]

    def nvmlEventSetCreate(self) -> str:
        return "eventset"

    def nvmlDeviceRegisterEvents(self, handle: int, mask: int, event_set: str) -> None:
        assert event_set == "eventset"
        self._dev(handle)
        self.registered.append((handle, mask))

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        self.wait_timeouts.append(timeout_ms)
        if not self.pending:
            raise NVMLError(self.NVML_ERROR_TIMEOUT)  # what NVML answers when nothing arrived in time
        return self.pending.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass
