"""``python -m apiary.drills DRILL [--api URL] [options]``: run one drill now, print its table.

Exit code 0 when the drill passed, 1 when it failed or was aborted. The scheduled runs are the
Prefect deployments of flows/drills.py (``apiary up`` serves them).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from apiary.drills.run import DRILLS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m apiary.drills", description="Run one Apiary drill now.")
    p.add_argument("drill", choices=sorted(DRILLS))
    p.add_argument("--api", default=None, help="control-plane URL (default APIARY_API_URL or the running apiary up)")
    p.add_argument("--vc", action="append", dest="virtual_clusters", help="inspection: probe only this VC")
    p.add_argument("--slo-s", type=float, default=None, help="inspection: SLO, seconds")
    p.add_argument("--node", action="append", dest="nodes", help="stress-drill: test only this node")
    p.add_argument("--no-cordon", action="store_true", help="stress-drill: report failed nodes, cordon none")
    p.add_argument("--rules", default=None, help="stress-drill: diagnosis rules YAML")
    p.add_argument("--experiment", action="append", dest="experiments", help="chaos-drill: run only this one")
    p.add_argument("--allow-disruptive", action="store_true", help="chaos-drill: also experiments that may "
                                                                   "disrupt guaranteed jobs")
    p.add_argument("--profile", default="smoke", help="load-drill: load profile (default smoke)")
    p.add_argument("--duration-s", type=float, default=None, help="load-drill: duration, seconds")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    kwargs: dict = {
        "inspection": {"virtual_clusters": a.virtual_clusters, "slo_s": a.slo_s},
        "stress-drill": {"nodes": a.nodes, "cordon": False if a.no_cordon else None, "rules": a.rules},
        "chaos-drill": {"experiments": a.experiments, "allow_disruptive": a.allow_disruptive},
        "load-drill": {"profile": a.profile, "duration_s": a.duration_s},
    }[a.drill]
    outcome = DRILLS[a.drill](a.api, **kwargs)
    if a.json:
        print(json.dumps({"drill": outcome.drill, "result": outcome.result, "summary": outcome.summary,
                          "rows": outcome.rows, "details": outcome.details}, default=str, indent=2))
    else:
        for row in outcome.rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
        print(f"{outcome.drill}: {outcome.result.upper()} - {outcome.summary}")
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    sys.exit(main())
