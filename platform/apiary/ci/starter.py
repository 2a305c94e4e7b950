"""Starting a pipeline for a delivery: the :class:`PipelineStarter` interface and its Prefect implementation.

The flows are flows/ci.py's ``platform-ci`` and ``platform-deploy``, served by flows/serve.py. When
their deployments are not registered (or ``PREFECT_API_URL`` is not set), :class:`PrefectStarter`
answers :class:`Pending` with the reason and the intake keeps the delivery recorded as
``pending``: nothing is lost, nothing is started.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from apiary.ci.webhooks import PipelineRequest
from apiary.errors import UnavailableError

logger = logging.getLogger(__name__)

DEFAULT_PR_DEPLOYMENT = "platform-ci/pr"
DEFAULT_DEPLOY_DEPLOYMENT = "platform-deploy/main"


@dataclass(frozen=True)
class Started:
    """The pipeline's run exists: ``flow_run_id`` (Prefect's flow run id, as text)."""

    flow_run_id: str


@dataclass(frozen=True)
class Pending:
    """Nothing was started and retrying now would not help (no such deployment yet): ``reason``."""

    reason: str


class StartLater(UnavailableError):
    """The pipeline could not be started now (Prefect not reachable, a 5xx); try again later."""


class PipelineStarter(ABC):
    """Starts the pipeline a delivery asks for.

    Idempotent on ``delivery``: starting the same delivery twice starts one pipeline (the Prefect
    implementation passes the delivery id as the flow run's idempotency key). It may block for a
    network round trip, so the intake never calls it on a request's path: it runs in the intake's
    background thread, after the delivery is committed. It returns :class:`Started` or
    :class:`Pending` (nothing to start yet, with why) and raises :class:`StartLater` for "try
    again"; any other exception is a failure the intake records as ``failed``.
    """

    @abstractmethod
    def start(self, delivery: str, request: PipelineRequest) -> Started | Pending:
        """Start the pipeline for ``request`` (GitHub delivery id ``delivery``)."""


class PrefectStarter(PipelineStarter):
    """Creates a flow run of a Prefect deployment: ``pr_deployment`` for a pull request,
    ``deploy_deployment`` for a push to the default branch (``flow-name/deployment-name``), with
    the request's fields as parameters and tags ``ci``, ``github``, the kind.

    ``client_factory`` returns a context manager of Prefect's sync client (default
    ``prefect.get_client(sync_client=True)``, which reads ``PREFECT_API_URL``); tests pass a fake.
    A deployment that does not exist is :class:`Pending`; an unreachable Prefect is :class:`StartLater`.
    """

    def __init__(self, pr_deployment: str = DEFAULT_PR_DEPLOYMENT, deploy_deployment: str = DEFAULT_DEPLOY_DEPLOYMENT,
                 client_factory: Callable[[], Any] | None = None) -> None:
        self.deployments = {"pr": pr_deployment, "deploy": deploy_deployment}
        self._client_factory = client_factory or _prefect_client

    def start(self, delivery: str, request: PipelineRequest) -> Started | Pending:
        import httpx
        from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

        name = self.deployments[request.kind]
        if self._client_factory is _prefect_client and not os.environ.get("PREFECT_API_URL"):
            # Without it Prefect's client would start a throw-away in-process server, and the run
            # would be created where no worker serves it.
            return Pending(f"PREFECT_API_URL is not set in the control plane's environment: {name} cannot be "
                           f"started; the delivery is kept")
        try:
            with self._client_factory() as client:
                try:
                    deployment = client.read_deployment_by_name(name)
                except ObjectNotFound:
                    return Pending(f"Prefect deployment {name} does not exist (yet); the delivery is kept, "
                                   f"nothing was started")
                run = client.create_flow_run_from_deployment(
                    deployment.id, parameters={"request": request.parameters(), "delivery": delivery},
                    tags=["ci", "github", request.kind], idempotency_key=f"github-delivery-{delivery}",
                )
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code < 500:
                raise  # Prefect refused the run (bad parameters?): a failure, not "try again"
            raise StartLater(f"Prefect failed to start {name}: {exc}") from exc
        except (httpx.HTTPError, OSError) as exc:
            raise StartLater(f"Prefect is not reachable to start {name}: {type(exc).__name__}: {exc}") from exc
        return Started(str(run.id))


def _prefect_client() -> Any:
    from prefect import get_client

    return get_client(sync_client=True)
