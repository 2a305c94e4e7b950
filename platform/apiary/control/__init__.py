"""The control plane: job service, scheduling cycles, node reports (see :mod:`apiary.control.plane`)."""

from apiary.control.plane import ControlPlane, CycleResult

__all__ = ["ControlPlane", "CycleResult"]
