"""Locust profile ``smoke``: ``python -m locust --headless -f loadtests/smoke.py --host URL`` (with the
environment ``apiary load run --profile smoke`` prepares; see loadtests/README.md)."""

from __future__ import annotations

from apiary_shapes import SteadyShape
from apiary_users import MLEngineer, NodeAgentReports, NodeAgentWatch, Operator

__all__ = ["MLEngineer", "Operator", "NodeAgentReports", "NodeAgentWatch", "SmokeProfile"]


class SmokeProfile(SteadyShape):
    profile = "smoke"
