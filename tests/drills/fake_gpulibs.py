"""Stand-ins for the parts of PyTorch and CuPy that examples/stress/bench.py uses, on a fake device.

The device has a clock that only its work advances: a matrix product of n x n costs
``2 n^3 / gemm_tflops[dtype]`` (TFLOP/s), a device copy ``2 * bytes / hbm_gbps`` (read + written),
a host<->device copy ``bytes / pcie_gbps``. CUDA events read that clock. So the benchmark's figures
must come out as exactly these rates: a test of the units and of the timing code's shape, not of a GPU.
Names follow the real libraries (``torch.cuda.Event(enable_timing=True)``, ``cupy.cuda.get_elapsed_time``,
``MemoryPointer.copy_from_host_async``), so a typo in bench.py fails here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


@dataclass
class FakeDevice:
    """The rates of one fake GPU; ``now`` is its clock (seconds), ``calls`` counts the work."""

    name: str = "Fake H200"
    gemm_tflops: dict[str, float] = field(default_factory=lambda: {"bfloat16": 700.0, "float16": 700.0,
                                                                   "float32": 50.0})
    hbm_gbps: float = 4000.0
    h2d_gbps: float = 50.0
    d2h_gbps: float = 40.0
    now: float = 0.0
    calls: int = 0

    def matmul(self, a: FakeArray, out: FakeArray) -> FakeArray:
        self.calls += 1
        self.now += 2.0 * a.n**3 / (self.gemm_tflops[a.dtype] * 1e12)
        return out

    def copy(self, dst: FakeArray, src: FakeArray) -> None:
        self.calls += 1
        if dst.on_device and src.on_device:
            self.now += 2.0 * dst.nbytes / (self.hbm_gbps * 1e9)
        elif dst.on_device:
            self.now += dst.nbytes / (self.h2d_gbps * 1e9)
        else:
            self.now += dst.nbytes / (self.d2h_gbps * 1e9)


@dataclass
class FakeArray:
    """A tensor (torch) or an array (cupy): its size, dtype and where it lives."""

    device: FakeDevice
    nbytes: int
    dtype: str
    on_device: bool = True
    n: int = 0  # the side of a square matrix

    # torch.Tensor.copy_
    def copy_(self, src: FakeArray, non_blocking: bool = False) -> FakeArray:
        assert non_blocking or (self.on_device and src.on_device), "host copies must be asynchronous (pinned)"
        self.device.copy(self, src)
        return self

    # cupy.ndarray.astype and .data (a MemoryPointer)
    def astype(self, dtype: str) -> FakeArray:
        return FakeArray(self.device, self.n * self.n * _SIZE[dtype], dtype, n=self.n)

    @property
    def data(self) -> SimpleNamespace:
        dev = self.device

        def from_device(src: Any, size: int, stream: Any) -> None:
            assert size == self.nbytes
            dev.copy(self, FakeArray(dev, size, "uint8"))

        def from_host(mem: Any, size: int, stream: Any) -> None:
            assert size == self.nbytes and mem.value  # a ctypes.c_void_p to pinned memory
            dev.copy(self, FakeArray(dev, size, "uint8", on_device=False))

        def to_host(mem: Any, size: int, stream: Any) -> None:
            assert size == self.nbytes and mem.value
            dev.copy(FakeArray(dev, size, "uint8", on_device=False), self)

        return SimpleNamespace(copy_from_device_async=from_device, copy_from_host_async=from_host,
                               copy_to_host_async=to_host)


_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}


class _Event:
    def __init__(self, devices: list[FakeDevice], current: list[int], **kw: Any) -> None:
        self._devices, self._current, self.t = devices, current, None

    def record(self, stream: Any = None) -> None:
        self.t = self._devices[self._current[0]].now

    def synchronize(self) -> None:
        assert self.t is not None, "synchronize before record"

    def elapsed_time(self, end: _Event) -> float:  # torch: milliseconds
        return (end.t - self.t) * 1e3


class _Lib:
    """What the two fakes share: the devices and which is current."""

    def __init__(self, devices: list[FakeDevice]) -> None:
        self.devices = devices
        self._current = [0]
        self.used: list[int] = []  # the ordinals made current, in order

    @contextlib.contextmanager
    def _use(self, ordinal: int):
        prev = self._current[0]
        self._current[0] = ordinal
        self.used.append(ordinal)
        try:
            yield
        finally:
            self._current[0] = prev

    @property
    def dev(self) -> FakeDevice:
        return self.devices[self._current[0]]


class FakeTorch(_Lib):
    """``torch`` with CUDA devices ``devices`` (none: ``cuda.is_available()`` is False)."""

    bfloat16, float32, uint8 = "bfloat16", "float32", "uint8"

    def __init__(self, devices: list[FakeDevice]) -> None:
        super().__init__(devices)
        self.precision = "default"
        lib = self
        self.cuda = SimpleNamespace(
            is_available=lambda: bool(devices), device_count=lambda: len(devices),
            get_device_name=lambda i: devices[i].name, device=self._use,
            Event=lambda **kw: _Event(devices, lib._current, **kw), empty_cache=lambda: None)

    def set_float32_matmul_precision(self, precision: str) -> None:
        self.precision = precision

    def device(self, kind: str, ordinal: int) -> tuple[str, int]:
        return (kind, ordinal)

    def randn(self, n: int, m: int, *, device: Any, dtype: str) -> FakeArray:
        assert device == ("cuda", self._current[0]), "tensors on the current device"
        return FakeArray(self.dev, n * m * _SIZE[dtype], dtype, n=n)

    def empty(self, nbytes: int, *, dtype: str, device: Any = None, pin_memory: bool = False) -> FakeArray:
        assert (device is None) == pin_memory, "host buffers pinned, device buffers on the device"
        return FakeArray(self.dev, nbytes, dtype, on_device=device is not None)

    def empty_like(self, a: FakeArray) -> FakeArray:
        return FakeArray(a.device, a.nbytes, a.dtype, a.on_device, a.n)

    def matmul(self, a: FakeArray, b: FakeArray, *, out: FakeArray) -> FakeArray:
        assert a.dtype == b.dtype == out.dtype and a.n == b.n
        return a.device.matmul(a, out)


class FakeCupy(_Lib):
    """``cupy`` with CUDA devices ``devices`` (none: ``getDeviceCount`` raises, as CuPy's does)."""

    float16, float32, uint8 = "float16", "float32", "uint8"

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, devices: list[FakeDevice]) -> None:
        super().__init__(devices)
        lib = self

        def count() -> int:
            if not devices:
                raise FakeCupy.CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
            return len(devices)

        runtime = SimpleNamespace(getDeviceCount=count, CUDARuntimeError=FakeCupy.CUDARuntimeError,
                                  getDeviceProperties=lambda i: {"name": devices[i].name.encode()})
        self.cuda = SimpleNamespace(
            runtime=runtime, Device=self._use, get_current_stream=lambda: "stream",
            Event=lambda: _Event(devices, lib._current),
            get_elapsed_time=lambda start, end: start.elapsed_time(end),
            alloc_pinned_memory=lambda n: SimpleNamespace(ptr=0x1000, size=n))
        self.random = SimpleNamespace(standard_normal=self._normal)
        self.freed = 0

    def _normal(self, shape: tuple[int, int], dtype: str) -> FakeArray:
        n, m = shape
        return FakeArray(self.dev, n * m * _SIZE[dtype], dtype, n=n)

    def empty(self, nbytes: int, dtype: str) -> FakeArray:
        return FakeArray(self.dev, nbytes, dtype)

    def empty_like(self, a: FakeArray) -> FakeArray:
        return FakeArray(a.device, a.nbytes, a.dtype, a.on_device, a.n)

    def matmul(self, a: FakeArray, b: FakeArray, out: FakeArray) -> FakeArray:
        assert a.dtype == b.dtype == out.dtype and a.n == b.n
        return a.device.matmul(a, out)

    def get_default_memory_pool(self) -> SimpleNamespace:
        def free_all_blocks() -> None:
            self.freed += 1
        return SimpleNamespace(free_all_blocks=free_all_blocks)


def importer(**modules: Any):
    """An ``import_module`` that knows only ``modules`` (None or absent: ImportError)."""
    def import_module(name: str) -> Any:
        if modules.get(name) is None:
            raise ImportError(f"No module named '{name}'")
        return modules[name]
    return import_module
