"""The metric names Apiary exports, and a regex-based extraction of metric names from PromQL.

``KNOWN_METRICS`` is the contract with the exporters (``platform/apiary/monitoring``, listed in
its ``METRICS.md``): alert rules and dashboards may use only these names, plus Prometheus' own
``up``.
"""

from __future__ import annotations

import re

DCGM_METRICS = {
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    # health beyond ECC/XID (apiary.monitoring.gpu_health.HEALTH_FIELDS)
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_PENDING",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DEV_RETIRED_SBE",
    "DCGM_FI_DEV_RETIRED_DBE",
    "DCGM_FI_DEV_RETIRED_PENDING",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
    "DCGM_FI_DEV_PCIE_LINK_GEN",
    "DCGM_FI_DEV_PCIE_LINK_WIDTH",
    "DCGM_FI_DEV_PCIE_MAX_LINK_GEN",
    "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH",
}
NODE_METRICS = {
    "apiary_gpu_foreign_processes",
    "apiary_node_gpu_count",
    "apiary_node_gpu_expected",
    "apiary_nvml_available",
    "apiary_host_cpu_utilization_ratio",
    "apiary_host_memory_used_bytes",
    "apiary_host_memory_available_bytes",
    "apiary_host_memory_used_ratio",
    "apiary_host_disk_used_ratio",
    "apiary_host_disk_free_bytes",
    "apiary_host_network_receive_bytes_total",
    "apiary_host_network_transmit_bytes_total",
    "apiary_task_cpu_ratio",
    "apiary_task_memory_bytes",
    "apiary_task_gpu_utilization_ratio",
}
CONTROL_PLANE_METRICS = {
    "apiary_jobs",
    "apiary_job_queue_length",
    "apiary_job_waiting_seconds",
    "apiary_scheduling_cycle_seconds_bucket",
    "apiary_scheduling_cycle_seconds_sum",
    "apiary_scheduling_cycle_seconds_count",
    "apiary_scheduling_last_cycle_timestamp_seconds",
    "apiary_preemptions_total",
    "apiary_vc_cells",
    "apiary_node_healthy",
    "apiary_node_cordoned",
    "apiary_service_heartbeat_timestamp_seconds",
    # drills (apiary.drills.board, reported through POST /api/v2/drills/results)
    "apiary_probe_success",
    "apiary_probe_duration_seconds",
    "apiary_probe_last_run_timestamp_seconds",
    "apiary_probe_runs_total",
    "apiary_drill_result",
    "apiary_drill_last_run_timestamp_seconds",
    "apiary_drill_last_success_timestamp_seconds",
    "apiary_drill_duration_seconds",
    "apiary_drill_runs_total",
    "apiary_drill_node_failed",
    # CI/CD records (apiary.ci.records, reported through POST /api/v2/ci/runs and /api/v2/deployments)
    "apiary_ci_stage_duration_seconds_bucket",
    "apiary_ci_stage_duration_seconds_sum",
    "apiary_ci_stage_duration_seconds_count",
    "apiary_ci_runs_total",
    "apiary_ci_default_branch_last_run_success",
    "apiary_deploy_total",
    "apiary_deploy_rollbacks_total",
    "apiary_deploy_duration_seconds",
    "apiary_deploy_last_success_timestamp_seconds",
    # incidents (apiary.incidents.stats over the stored incidents; apiary.monitoring.incident_metrics)
    "apiary_incidents_open",
    "apiary_incident_mtta_seconds",
    "apiary_incident_mttm_seconds",
    "apiary_incident_mttr_seconds",
    "apiary_incident_sla_breaches_total",
    "apiary_incidents_total",
    "apiary_incident_notifications_total",
    "apiary_incident_escalations_total",
}
PROMETHEUS_METRICS = {"up"}
KNOWN_METRICS = DCGM_METRICS | NODE_METRICS | CONTROL_PLANE_METRICS | PROMETHEUS_METRICS

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "atan2", "inf", "nan", "start", "end",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_IDENT = re.compile(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_NUMBER_SUFFIX = re.compile(r"^\d")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (identifiers that are not functions, keywords or labels)."""
    s = _GRAFANA_VAR.sub("0", expr)  # Grafana variables, before strings lose their content
    s = _STRING.sub('""', s)
    s = _MATCHERS.sub("", s)
    s = _RANGE.sub("", s)
    s = _GROUPING.sub(" ", s)
    names: set[str] = set()
    for m in _IDENT.finditer(s):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS or _NUMBER_SUFFIX.match(name):
            continue
        names.add(name)
    return names


def label_values_metric(query: str) -> set[str]:
    """Metric names in a Grafana Prometheus variable query (``label_values(metric{...}, label)`` etc.)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query, re.S)
    if m:
        return metric_names(m.group(1))
    m = re.fullmatch(r"\s*(?:query_result|metrics)\((.*)\)\s*", query, re.S)
    if m:
        return metric_names(m.group(1))
    return set()
