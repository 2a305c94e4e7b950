"""Serve the Apiary flows as Prefect deployments: ``python flows/serve.py``.

* ``apiary-job/submit``: run form = the job spec; submits to Apiary and waits;
* ``scheduling-loop/loop``: every 60 s, 60 scheduler cycles 1 s apart.

Both read ``APIARY_API_URL`` (passed as the default ``api_url`` parameter) and need
``PREFECT_API_URL`` pointing at the Prefect server.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# flows/ is not a package: make its siblings importable when run as a script.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from job import apiary_job  # noqa: E402
from prefect import serve  # noqa: E402
from scheduling import scheduling_loop  # noqa: E402


def main() -> None:
    api_url = os.environ.get("APIARY_API_URL")
    submit = apiary_job.to_deployment(
        name="submit",
        parameters={"api_url": api_url} if api_url else None,
        description="Submit an OpenPAI job to Apiary and wait for it to finish.",
        tags=["apiary"],
    )
    loop = scheduling_loop.to_deployment(
        name="loop",
        interval=60,
        parameters={"api_url": api_url, "cycles": 60, "interval_s": 1.0} if api_url else None,
        description="Drive Apiary's scheduler and record its decisions.",
        tags=["apiary"],
    )
    serve(submit, loop)


if __name__ == "__main__":
    main()
