"""Apiary's chaostoolkit extension: chaos experiments against a live platform.

Experiments (``chaos/*.json``) call plain functions, the chaostoolkit way::

    {"type": "action", "name": "kill-control-plane",
     "provider": {"type": "python", "module": "apiary.chaos.actions", "func": "kill_child",
                  "arguments": {"name": "control-plane"}}}

* :mod:`apiary.chaos.probes`: the steady state (API healthy, a probe job within its SLO, store and
  scheduler consistent, no accepted job lost, no task run started twice) and what a method checks
  (a child restarted, a fault visible in the node's metrics, a job failed as the exit spec says).
  A probe returns a value when the hypothesis holds and raises :class:`SteadyStateViolation` with
  the reason when it does not, so the journal carries the reason (experiments use
  ``"tolerance": true``).
* :mod:`apiary.chaos.actions`: kill -9 of a platform process, node freeze ("VM stop"), simulated
  GPU faults, a job that runs out of GPU memory, a full store disk, a degraded network between an
  agent and the control plane; each undo is an action too, for the experiment's rollbacks.
* :mod:`apiary.chaos.runner`: runs an experiment with ``chaos run`` as a subprocess and judges its
  journal (:mod:`apiary.chaos.journal`); ``apiary chaos run`` is its CLI.

The platform is found through the experiment's configuration (:mod:`apiary.chaos.target`):
``apiary_url``, ``apiary_token`` and ``apiary_home``, normally read from ``APIARY_API_URL``,
``APIARY_TOKEN`` and ``APIARY_HOME``.
"""

from __future__ import annotations

from apiary.errors import PlatformError


class SteadyStateViolation(PlatformError):
    """A probe found the platform outside its steady state; the message says how."""

    code = "SteadyStateViolation"
