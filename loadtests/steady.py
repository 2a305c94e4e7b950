"""Locust profile ``steady``: ``python -m locust --headless -f loadtests/steady.py --host URL`` (with the
environment ``apiary load run --profile steady`` prepares; see loadtests/README.md)."""

from __future__ import annotations

from apiary_shapes import SteadyShape
from apiary_users import MLEngineer, NodeAgentReports, NodeAgentWatch, Operator

__all__ = ["MLEngineer", "Operator", "NodeAgentReports", "NodeAgentWatch", "SteadyProfile"]


class SteadyProfile(SteadyShape):
    profile = "steady"
