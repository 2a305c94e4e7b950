"""Apiary: a multi-tenant GPU cluster platform.

OpenPAI job protocol v2 jobs, HiveD scheduling, a node runtime and a Prefect-tracked
lifecycle. See ``platform/ARCHITECTURE.md`` for the packages and their contracts.
"""

__version__ = "0.1.0"
