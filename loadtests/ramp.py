"""Locust profile ``ramp``: ``python -m locust --headless -f loadtests/ramp.py --host URL`` (with the
environment ``apiary load run --profile ramp`` prepares; see loadtests/README.md)."""

from __future__ import annotations

from apiary_shapes import RampShape
from apiary_users import MLEngineer, NodeAgentReports, NodeAgentWatch, Operator

__all__ = ["MLEngineer", "Operator", "NodeAgentReports", "NodeAgentWatch", "RampProfile"]


class RampProfile(RampShape):
    profile = "ramp"
