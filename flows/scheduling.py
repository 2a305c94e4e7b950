"""Prefect flow ``scheduling-loop``: drive Apiary's scheduler and record what it decided.

Calls ``POST /api/v2/scheduler/cycle`` every ``interval_s`` seconds, ``cycles`` times, and
publishes a table artifact (cycle, placed, preempted, waiting, durationMs). Apiary runs
cycles on its own too, so this flow is an observer/driver, never on the launch path.

Who it acts as: the bridge's service token (which may run scheduling cycles, nothing an admin
alone may do), sent only to the platform's configured URL (``APIARY_API_URL``); no parameter names
a URL. ``cycles`` and ``interval_s`` are bounded, so a run from the UI cannot drive the
scheduler flat out for hours.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import httpx
from prefect import flow, get_run_logger
from prefect.artifacts import acreate_table_artifact
from pydantic import Field

from apiary.errors import PlatformError
from apiary.tracking.source import service_headers
from apiary.tracking.submit import platform_api_url, platform_verify, run_scheduler_cycle


@flow(name="scheduling-loop", persist_result=False)
async def scheduling_loop(
    cycles: Annotated[int, Field(ge=1, le=3600, description="How many cycles (1 to 3600).")] = 60,
    interval_s: Annotated[float, Field(ge=0.01, le=600, description="Seconds between cycles (0.01 to 600).")] = 1.0,
) -> list[dict]:
    """Run ``cycles`` scheduler cycles ``interval_s`` apart; return one row per cycle."""
    log = get_run_logger()
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=platform_api_url(), timeout=30.0, headers=service_headers(),
                                 verify=platform_verify()) as client:
        for cycle in range(cycles):
            try:
                result = await run_scheduler_cycle(client)
            except PlatformError as exc:  # 5xx or unreachable (UnavailableError): skip this cycle
                log.warning("cycle=%s skipped: %s", cycle, exc.message)
                result = {"placed": [], "preempted": [], "waiting": {}, "durationMs": None, "error": exc.message}
            waiting = result.get("waiting") or {}
            rows.append({
                "cycle": cycle,
                "placed": ", ".join(result.get("placed") or []),
                "preempted": ", ".join(result.get("preempted") or []),
                # A long queue would make the artifact huge: count them, show the first few.
                "waitingCount": len(waiting),
                "waiting": "; ".join(f"{j}: {r}" for j, r in list(waiting.items())[:10]),
                "durationMs": result.get("durationMs"),
            })
            if result.get("placed") or result.get("preempted"):
                log.info("cycle=%s placed=%s preempted=%s waiting=%s", cycle, result.get("placed"),
                         result.get("preempted"), len(waiting))
            if cycle + 1 < cycles:
                await asyncio.sleep(interval_s)
    await acreate_table_artifact(key="scheduling-loop", table=rows,
                                 description=f"{cycles} scheduler cycles, {interval_s} s apart")
    logging.getLogger(__name__).debug("scheduling loop done cycles=%s", cycles)
    return rows
