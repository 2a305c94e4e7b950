"""Locust profile ``spike``: ``python -m locust --headless -f loadtests/spike.py --host URL`` (with the
environment ``apiary load run --profile spike`` prepares; see loadtests/README.md)."""

from __future__ import annotations

from apiary_shapes import SpikeShape
from apiary_users import MLEngineer, NodeAgentReports, NodeAgentWatch, Operator

__all__ = ["MLEngineer", "Operator", "NodeAgentReports", "NodeAgentWatch", "SpikeProfile"]


class SpikeProfile(SpikeShape):
    profile = "spike"
