"""A real Prefect server for the flow tests, one per module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from apiary.tracking.prefect_server import new_auth_string, start_prefect_server


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API URL of a Prefect server on loopback, protected as ``apiary up`` runs it (basic auth:
    the submit form's user is trusted only behind it), with this process's Prefect client pointed
    at it for the module."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, PREFECT_HOME, temporary_settings

    srv = start_prefect_server(tmp_path_factory.mktemp("prefect-server"), auth_string=new_auth_string())
    client_home = tmp_path_factory.mktemp("prefect-client")
    try:
        with temporary_settings(updates={PREFECT_API_URL: srv.api_url, PREFECT_HOME: str(client_home),
                                         PREFECT_API_AUTH_STRING: srv.auth_string}):
            yield srv.api_url
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)  # ship queued flow logs before the server goes away
    finally:
        srv.stop()
