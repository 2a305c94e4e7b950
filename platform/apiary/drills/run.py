"""One entry point per drill, with the settings resolved: what the Prefect flows (flows/drills.py)
and ``python -m apiary.drills`` call.

``api_url`` is for a trusted caller on the host (``python -m apiary.drills --api``); the Prefect
flows never pass one, so the drills' admin token goes only to the platform's configured URL
(:func:`apiary.tracking.submit.platform_api_url`).

Each returns a :class:`~apiary.drills.common.DrillOutcome` and has reported it to the control
plane (``POST /api/v2/drills/results``). A drill that cannot even start (the API unreachable, a
bad rules file) is a ``failed`` outcome too, reported when the API answers, so that
``apiary_drill_result`` and the staleness alert see it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from apiary.drills.common import DrillApi, DrillOutcome, DrillSettings, record
from apiary.drills.guard import GuardConfig
from apiary.errors import ApiaryError, UserError

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
CHAOS_DIR = REPO_ROOT / "chaos"


def _safely(drill: str, api_url: str | None, body: Callable[[DrillApi, DrillSettings], DrillOutcome]) -> DrillOutcome:
    settings = DrillSettings()
    started = time.time()
    api: DrillApi | None = None
    try:
        api = DrillApi.from_env(api_url, settings)
        return body(api, settings)
    except ApiaryError as e:
        logger.error("drill=%s could not run: %s", drill, e.message)
        outcome = DrillOutcome(drill=drill, result="failed", summary=f"the drill could not run: {e.message}",
                               started_at=started, finished_at=time.time(),
                               rows=[{"drill": drill, "result": "failed", "error": e.message}])
        if api is not None:
            record(api, outcome)
        return outcome
    finally:
        if api is not None:
            api.close()


def _guard(settings: DrillSettings) -> GuardConfig:
    return GuardConfig(max_probe_failures=settings.guard_max_probe_failures, interval_s=settings.guard_interval_s,
                       probe_slo_s=settings.guard_probe_slo_s)


def inspection(api_url: str | None = None, *, virtual_clusters: list[str] | None = None,
               slo_s: float | None = None) -> DrillOutcome:
    """Probe every VC (or ``virtual_clusters``) against ``slo_s`` (default ``APIARY_DRILL_PROBE_SLO_S``)."""
    from apiary.drills.inspection import run_inspection

    return _safely("inspection", api_url, lambda api, s: run_inspection(
        api, virtual_clusters, slo_s=slo_s or s.probe_slo_s, image=s.image))


def stress_drill(api_url: str | None = None, *, nodes: list[str] | None = None, cordon: bool | None = None,
                 timeout_s: float | None = None, rules: str | None = None) -> DrillOutcome:
    """Benchmark every node (or ``nodes``), diagnose with ``rules`` (default ``APIARY_DRILL_RULES``,
    else the packaged rules.yaml), cordon failed nodes unless ``cordon`` is False."""
    from apiary.drills.diagnosis import load_rules
    from apiary.drills.stress import run_stress

    def body(api: DrillApi, s: DrillSettings) -> DrillOutcome:
        return run_stress(api, load_rules(rules or s.rules), image=s.image, nodes=nodes,
                          timeout_s=timeout_s or s.stress_timeout_s,
                          cordon=s.stress_cordon if cordon is None else cordon)

    return _safely("stress-drill", api_url, body)


def chaos_drill(api_url: str | None = None, *, experiments: list[str] | None = None, chaos_dir: str | None = None,
                timeout_s: float = 300.0, allow_disruptive: bool = False, tagged_only: bool = False) -> DrillOutcome:
    """Run the experiments of ``chaos_dir`` (default the repository's ``chaos/``) tagged for drills,
    or those named in ``experiments``, each under the guard.

    ``tagged_only`` (what the Prefect flow passes): ``experiments`` may only pick among the ones the
    schedule runs (tagged for drills, neither ``root`` nor disruptive); a name outside them fails
    the drill before anything runs, naming it."""
    from apiary.drills.adapters import SKIP_TAGS, chaos_experiments
    from apiary.drills.live import run_chaos_drill
    from apiary.settings import Settings

    def body(api: DrillApi, s: DrillSettings) -> DrillOutcome:
        home = Settings().home_dir
        journals = home / "drills" / "chaos" / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        directory = Path(chaos_dir) if chaos_dir else CHAOS_DIR
        if tagged_only:
            allowed = chaos_experiments(directory, skip_tags=SKIP_TAGS)
            unknown = sorted(set(experiments or ()) - {p.name for p in allowed} - {p.stem for p in allowed})
            if unknown:
                raise UserError(f"experiments: not among the experiments tagged for drills: {', '.join(unknown)} "
                                f"(those are: {', '.join(p.stem for p in allowed) or 'none'})")
        picked = chaos_experiments(directory, names=experiments, allow_disruptive=allow_disruptive and not tagged_only,
                                   skip_tags=SKIP_TAGS)
        guard = _guard(s)
        guard.allow_disruption = allow_disruptive
        return run_chaos_drill(api, picked, home=home, journal_dir=journals, timeout_s=timeout_s, guard=guard,
                               image=s.image)

    return _safely("chaos-drill", api_url, body)


def load_drill(api_url: str | None = None, *, profile: str = "smoke", duration_s: float | None = None) -> DrillOutcome:
    """Run the load ``profile`` (default ``smoke``) for ``duration_s`` (default: the profile's) under the guard."""
    from apiary.drills.live import run_load_drill
    from apiary.settings import Settings

    def body(api: DrillApi, s: DrillSettings) -> DrillOutcome:
        out = Settings().home_dir / "drills" / "load" / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        return run_load_drill(api, profile=profile, duration_s=duration_s, out_dir=out, guard=_guard(s),
                              image=s.image)

    return _safely("load-drill", api_url, body)


#: The drills by name (the flows' and ``python -m apiary.drills``'s names).
DRILLS: dict[str, Callable[..., DrillOutcome]] = {
    "inspection": inspection, "stress-drill": stress_drill, "chaos-drill": chaos_drill, "load-drill": load_drill,
}
