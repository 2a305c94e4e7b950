"""Serve the Apiary flows as Prefect deployments: ``python flows/serve.py``.

* ``apiary-job/submit``: run form = the job spec; submits to Apiary and waits;
* ``what-if-replay/whatif``: a trace replay from the UI (see flows/whatif.py);
* ``scheduling-loop/loop``: every 60 s, 10 scheduler cycles 1 s apart (the control plane runs its
  own loop as well; this one records decisions and keeps a flow-run subprocess alive 10 s a minute,
  not all the time).

Both read ``APIARY_API_URL`` (passed as the default ``api_url`` parameter) and need
``PREFECT_API_URL`` pointing at the Prefect server.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# flows/ is not a package: make its siblings importable when run as a script.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefect import serve  # noqa: E402

from job import apiary_job  # noqa: E402
from scheduling import scheduling_loop  # noqa: E402
from whatif import what_if_replay  # noqa: E402


def deployments(api_url: str | None = None) -> list:
    """The deployments (``submit``, ``loop``, ``whatif``); ``api_url`` defaults to ``APIARY_API_URL``."""
    api_url = api_url or os.environ.get("APIARY_API_URL")
    submit = apiary_job.to_deployment(
        name="submit",
        parameters={"api_url": api_url} if api_url else None,
        description="Submit an OpenPAI job to Apiary and wait for it to finish.",
        tags=["apiary"],
    )
    loop = scheduling_loop.to_deployment(
        name="loop",
        interval=60,
        parameters={"api_url": api_url, "cycles": 10, "interval_s": 1.0} if api_url else {"cycles": 10},
        description="Drive Apiary's scheduler and record its decisions.",
        tags=["apiary"],
    )
    whatif = what_if_replay.to_deployment(
        name="whatif",
        description="Replay a job trace on a cluster under hived, quota and fifo; summary table and plots.",
        tags=["apiary", "simulator"],
    )
    return [submit, loop, whatif]


def main() -> None:
    serve(*deployments())


if __name__ == "__main__":
    main()
