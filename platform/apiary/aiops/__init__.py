"""AIOps, measured: anomaly detection over the platform's metrics and node-failure
prediction from precursors, trained and evaluated on the platform's own fault-injection drill runs.

* :mod:`.samples`: :class:`Frame` (one observation of nodes, jobs and VCs) assembled from the
  exported series (dcgm-exporter's names, ``apiary_task_*``, ``apiary_job_waiting_seconds``).
* :mod:`.drill_runs`: seeded runs of simulated nodes that degrade then fail, fail suddenly, or stay
  healthy with benign noise; faults injected into :class:`~apiary.monitoring.gpu.SimulatedGpus` and
  read back from the collectors' exposition. :data:`DRILL_INTERVAL_S` (300 s) is the inspection
  drill's cadence.
* :mod:`.config` and ``detectors.yaml``: the rules, each with ``enabled``.
* :mod:`.detectors`: river's ``GaussianScorer`` per series with a rule's thresholds.
* :mod:`.predictor`: :class:`Predictor` (online findings) and the failure model (scikit-learn).
* :mod:`.findings`: :class:`Finding` and :func:`finding_to_event` (PagerDuty Events API v2, Sev4).
* :mod:`.evaluate`: :func:`evaluate` -- precision, recall and lead time on held-out runs.
* :mod:`.live`: :class:`PrometheusSource` and :func:`scan_once` for the live platform.
"""

from apiary.aiops.config import ANOMALY_RULES, FAILURE_RULE, RULES, AiopsConfig, load_config, parse_config
from apiary.aiops.drill_runs import DRILL_INTERVAL_S, DrillRun, NodeFate, ScenarioConfig, generate_run
from apiary.aiops.evaluate import check_separate, evaluate, score_runs
from apiary.aiops.findings import Finding, finding_to_event
from apiary.aiops.live import PrometheusSource, scan_once
from apiary.aiops.predictor import FEATURES, FailureModel, Predictor, train
from apiary.aiops.samples import Frame, GpuReading, JobSample, NodeSample, assemble, parse_exposition

__all__ = [
    "ANOMALY_RULES",
    "DRILL_INTERVAL_S",
    "FAILURE_RULE",
    "FEATURES",
    "RULES",
    "AiopsConfig",
    "DrillRun",
    "FailureModel",
    "Finding",
    "Frame",
    "GpuReading",
    "JobSample",
    "NodeFate",
    "NodeSample",
    "Predictor",
    "PrometheusSource",
    "ScenarioConfig",
    "assemble",
    "check_separate",
    "evaluate",
    "finding_to_event",
    "generate_run",
    "load_config",
    "parse_config",
    "parse_exposition",
    "scan_once",
    "score_runs",
    "train",
]
