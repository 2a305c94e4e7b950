"""GPU health beyond ECC and XID: row remapping, retired pages, clock-throttle reasons, PCIe link.

Kept apart from :mod:`apiary.monitoring.gpu` (which imports it) so that module's classes stay about
reading and modelling one GPU; this one owns the health fields, how NVML answers them and how the
simulator models them:

* :data:`HEALTH_FIELDS` -- ``(GpuSample attribute, metric name, help)`` in exposition order, with
  dcgm-exporter's names (DCGM field ids 112, 235-238, 390-396). Every one has a DCGM name, so no
  ``apiary_gpu_...`` name is needed here.
* :func:`read_nvml_health` -- the NVML calls behind them. A call the GPU or driver answers
  ``NOT_SUPPORTED`` (page retirement on Ampere and newer, row remapping before Ampere, PCIe on an
  SXM board without it) leaves its fields ``None``: the collector then omits those samples for that
  GPU; the scrape never fails.
* :class:`HealthFaults` and :func:`simulated_health` -- the simulator's healthy values per SKU and
  the injectable fault kinds (``row_remap_failure``, ``row_remap_pending``, ``retired_pages``,
  ``throttle``, ``pcie_gen``, ``pcie_width``).

Clock-throttle bits are NVML's ``nvmlClocksEventReason*`` (formerly ``nvmlClocksThrottleReason*``)
constants, copied here because the simulator must not import ``pynvml``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# NVML clock event (throttle) reason bits, from nvml.h.
THROTTLE_GPU_IDLE = 0x1
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80

#: The ``throttle`` fault kinds and the bit each sets in DCGM_FI_DEV_CLOCK_THROTTLE_REASONS.
THROTTLE_FAULTS: dict[str, int] = {
    "thermal": THROTTLE_SW_THERMAL,
    "power": THROTTLE_SW_POWER_CAP,
    "hw_slowdown": THROTTLE_HW_SLOWDOWN,
}
#: PCIe generations and link widths a GPU can report (width: lanes).
PCIE_GENS = (1, 2, 3, 4, 5, 6)
PCIE_WIDTHS = (1, 2, 4, 8, 16, 32)

# (attribute of GpuSample, metric name, help) in exposition order; appended to DCGM_FIELDS.
HEALTH_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("remapped_rows_corr", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
     "Number of remapped rows for correctable errors."),
    ("remapped_rows_unc", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
     "Number of remapped rows for uncorrectable errors."),
    ("row_remap_pending", "DCGM_FI_DEV_ROW_REMAP_PENDING", "Whether remapping of rows is pending (1) or not (0)."),
    ("row_remap_failure", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed (1) or not (0)."),
    ("retired_sbe", "DCGM_FI_DEV_RETIRED_SBE", "Total number of retired pages due to single-bit errors."),
    ("retired_dbe", "DCGM_FI_DEV_RETIRED_DBE", "Total number of retired pages due to double-bit errors."),
    ("retired_pending", "DCGM_FI_DEV_RETIRED_PENDING",
     "Whether pages are pending retirement (1) or not (0)."),
    ("throttle_reasons", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
     "Current clock throttle reasons (bitmask of NVML's nvmlClocksEventReason* values)."),
    ("pcie_link_gen", "DCGM_FI_DEV_PCIE_LINK_GEN", "PCIe current link generation."),
    ("pcie_link_width", "DCGM_FI_DEV_PCIE_LINK_WIDTH", "PCIe current link width (lanes)."),
    ("pcie_max_link_gen", "DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "PCIe maximum link generation of GPU and system."),
    ("pcie_max_link_width", "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "PCIe maximum link width of GPU and system (lanes)."),
)
HEALTH_ATTRS = tuple(attr for attr, _, _ in HEALTH_FIELDS)

#: ``read(what, fn, *args)``: call ``fn(*args)``; None when NVML answers an error (NvmlGpus._read).
Reader = Callable[..., Any]


def _first(nv: Any, *names: str) -> Callable[..., Any] | None:
    """The first of ``names`` the bindings define (None: too old for any of them)."""
    for name in names:
        fn = getattr(nv, name, None)
        if fn is not None:
            return fn
    return None


def _flag(value: Any) -> float | None:
    return None if value is None else (1.0 if int(value) else 0.0)


def read_nvml_health(nv: Any, read: Reader, h: Any) -> dict[str, float | None]:
    """The :data:`HEALTH_ATTRS` of device handle ``h`` through the ``pynvml`` module ``nv``:
    ``{attribute: value or None}``. ``read`` turns an NVMLError into None (and logs once unless it is
    NOT_SUPPORTED); a function the bindings lack counts as not supported. Never raises NVMLError.

    Sources: ``nvmlDeviceGetRemappedRows`` -> (corrRows, uncRows, isPending, failureOccurred);
    ``nvmlDeviceGetRetiredPages(h, cause)`` (list of page addresses; its length is the count) and
    ``nvmlDeviceGetRetiredPagesPendingStatus``; ``nvmlDeviceGetCurrentClocksEventReasons`` (older
    bindings: ``...ThrottleReasons``); ``nvmlDeviceGetCurrPcieLinkGeneration`` / ``...Width`` and
    ``nvmlDeviceGetMaxPcieLinkGeneration`` / ``...Width``. The max is NVML's "possible with this device
    and system" (not ``nvmlDeviceGetGpuMaxPcieLinkGeneration``, the GPU's alone): a gen-5 GPU in a
    gen-4 slot is at its maximum, not degraded.
    """
    out: dict[str, float | None] = dict.fromkeys(HEALTH_ATTRS)

    def call(what: str, names: tuple[str, ...], *args: Any) -> Any:
        fn = _first(nv, *names)
        return None if fn is None else read(what, fn, *args)

    rows = call("remapped rows", ("nvmlDeviceGetRemappedRows",), h)
    if rows is not None:
        corr, unc, pending, failure = rows
        out.update(remapped_rows_corr=float(corr), remapped_rows_unc=float(unc),
                   row_remap_pending=_flag(pending), row_remap_failure=_flag(failure))
    # pynvml's values of the two causes, as defaults for stand-in modules that do not define them
    sbe = call("retired pages (SBE)", ("nvmlDeviceGetRetiredPages",), h,
               getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0))
    dbe = call("retired pages (DBE)", ("nvmlDeviceGetRetiredPages",), h,
               getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1))
    out["retired_sbe"] = float(len(sbe)) if sbe is not None else None
    out["retired_dbe"] = float(len(dbe)) if dbe is not None else None
    out["retired_pending"] = _flag(call("retired pages pending", ("nvmlDeviceGetRetiredPagesPendingStatus",), h))
    reasons = call("clock throttle reasons",
                   ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), h)
    out["throttle_reasons"] = float(reasons) if reasons is not None else None
    for attr, what, name in (
        ("pcie_link_gen", "PCIe link generation", "nvmlDeviceGetCurrPcieLinkGeneration"),
        ("pcie_link_width", "PCIe link width", "nvmlDeviceGetCurrPcieLinkWidth"),
        ("pcie_max_link_gen", "PCIe max link generation", "nvmlDeviceGetMaxPcieLinkGeneration"),
        ("pcie_max_link_width", "PCIe max link width", "nvmlDeviceGetMaxPcieLinkWidth"),
    ):
        value = call(what, (name,), h)
        out[attr] = float(value) if value is not None else None
    return out


# ---------------------------------------------------------------------------------------- simulated


@dataclass
class HealthFaults:
    """The health faults of one simulated GPU (all cleared by a reset, :meth:`SimulatedGpus.clear`)."""

    row_remap_failure: bool = False
    row_remap_pending: bool = False
    retired_pages: int = 0  # pages retired for double-bit errors, pending until the reset
    throttle: str | None = None  # a key of THROTTLE_FAULTS
    pcie_gen: int | None = None  # trained link generation, below the SKU's maximum
    pcie_width: int | None = None  # trained link width (lanes)

    def active(self) -> dict[str, Any]:
        """The kinds that differ from healthy, ``{kind: value}`` (for :meth:`SimulatedGpus.faults`)."""
        out: dict[str, Any] = {}
        for k in ("row_remap_failure", "row_remap_pending", "retired_pages", "throttle", "pcie_gen", "pcie_width"):
            v = getattr(self, k)
            if v:
                out[k] = v
        return out


def check_health_faults(
    *,
    max_gen: int,
    max_width: int,
    page_retirement: bool,
    retired_pages: int | None = None,
    throttle: str | None = None,
    pcie_gen: int | None = None,
    pcie_width: int | None = None,
) -> None:
    """Raise ValueError naming the kind for a value the simulated SKU cannot report: ``retired_pages``
    < 0 or on a SKU that remaps rows instead of retiring pages; ``throttle`` not in
    :data:`THROTTLE_FAULTS`; ``pcie_gen`` / ``pcie_width`` outside 1..the SKU's maximum."""
    if retired_pages is not None:
        if retired_pages < 0:
            raise ValueError("retired_pages must be >= 0")
        if retired_pages and not page_retirement:
            raise ValueError("retired_pages: this GPU model remaps rows instead of retiring pages "
                             "(inject row_remap_pending or row_remap_failure)")
    if throttle is not None and throttle not in THROTTLE_FAULTS:
        raise ValueError(f"throttle must be one of {', '.join(THROTTLE_FAULTS)}, not {throttle!r}")
    if pcie_gen is not None and not 1 <= pcie_gen <= max_gen:
        raise ValueError(f"pcie_gen must be in 1..{max_gen} (the GPU's maximum), not {pcie_gen}")
    if pcie_width is not None and (pcie_width not in PCIE_WIDTHS or pcie_width > max_width):
        raise ValueError(f"pcie_width must be one of {[w for w in PCIE_WIDTHS if w <= max_width]}, not {pcie_width}")


def simulated_health(
    f: HealthFaults, *, util: float, max_gen: int, max_width: int, row_remapping: bool, page_retirement: bool
) -> dict[str, float | None]:
    """The :data:`HEALTH_ATTRS` of a simulated GPU at utilization ``util`` (%) with faults ``f``.

    Healthy: no remapped or retired rows, the link trained at the SKU's maximum, throttle reasons
    ``GPU idle`` (0x1) when idle else none -- what NVML answers on a healthy board. A SKU without row
    remapping (before Ampere) or without page retirement (Ampere and newer) leaves those fields None,
    like NVML's NOT_SUPPORTED. ``row_remap_pending`` counts one uncorrectable remapped row (the
    remap that waits for a reset); ``row_remap_failure`` sets the flag only (no spare row was left).
    """
    out: dict[str, float | None] = dict.fromkeys(HEALTH_ATTRS)
    if row_remapping:
        out.update(remapped_rows_corr=0.0, remapped_rows_unc=1.0 if f.row_remap_pending else 0.0,
                   row_remap_pending=float(f.row_remap_pending), row_remap_failure=float(f.row_remap_failure))
    if page_retirement:
        out.update(retired_sbe=0.0, retired_dbe=float(f.retired_pages), retired_pending=float(f.retired_pages > 0))
    bits = 0 if util > 0 else THROTTLE_GPU_IDLE
    if f.throttle is not None:
        bits |= THROTTLE_FAULTS[f.throttle]
    out["throttle_reasons"] = float(bits)
    out.update(pcie_link_gen=float(f.pcie_gen or max_gen), pcie_link_width=float(f.pcie_width or max_width),
               pcie_max_link_gen=float(max_gen), pcie_max_link_width=float(max_width))
    return out
