"""What every ``apiary`` command shares: the client of the platform, the way an API error is
printed, the settings and the log format.

The platform is found through ``APIARY_API_URL`` or the URL ``apiary up`` recorded in
``APIARY_HOME`` (default ``~/.apiary``); the token is ``APIARY_TOKEN``, else the file
``APIARY_HOME/token``. This module imports no other command module, so every command module may
import it (and :mod:`apiary.cli.tables`) without an import circle.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console

from apiary.errors import ApiaryError

if TYPE_CHECKING:
    from apiary.client import ApiaryClient
    from apiary.settings import Settings

#: Errors and notices (stderr).
err = Console(stderr=True)


def settings() -> Settings:
    """The settings of this process's environment (``APIARY_*``)."""
    from apiary.settings import Settings

    return Settings()


def api_client(token: str | None = None) -> ApiaryClient:
    """A client of the platform in APIARY_API_URL (one URL, or the control-plane replicas'
    comma-separated: the client fails over between them), else of the one ``apiary up`` recorded in
    APIARY_HOME, with ``token`` (default APIARY_TOKEN, else the file APIARY_HOME/token), verifying
    HTTPS against APIARY_CA_CERT (unset: the system's CAs). A recorded
    platform must prove it is that home's (its ``clusterId`` in /healthz): after a platform dies
    without cleaning up, another one may hold its port. Exits 1 (with the reason on stderr) when no
    platform is found or the one found is another home's; an unreachable one raises
    UnavailableError, as any call. A token bound for plain HTTP off loopback (PlaintextTokenError),
    a malformed URL or an unreadable CA file exits 1 with the message, which names the setting."""
    from apiary.client import ApiaryClient

    current = settings()
    url = current.resolved_api_url()
    if not url:
        err.print("No Apiary platform found: run `apiary up` or set APIARY_API_URL.")
        raise typer.Exit(1)
    try:
        client = ApiaryClient(url, token=token or current.resolved_token(), ca_cert=current.ca_cert)
    except ApiaryError as e:  # a plain-HTTP URL for a token, a bad URL or CA file: the message names the setting
        fail(e)
    expected = current.cluster_id()
    if current.api_url or expected is None:
        return client  # an explicit URL is trusted; a home from before cluster ids has nothing to check
    answered = client.health().get("clusterId")
    if answered != expected:
        err.print(
            f"error: the platform at {url} is cluster {answered or '(no cluster id)'}, but APIARY_HOME "
            f"{current.home_dir} belongs to cluster {expected}. Another Apiary platform holds that port; "
            "run apiary up for this home, or set APIARY_API_URL to use that platform.",
            markup=False, highlight=False, soft_wrap=True,
        )
        raise typer.Exit(1)
    return client


def fail(e: ApiaryError) -> NoReturn:
    """Print the API's error as ``error (<status>): <message>`` on stderr and exit 1."""
    err.print(f"[red]error[/red] ({e.status_code}): {e.message}")
    raise typer.Exit(1)


def setup_logging(verbose: bool = False) -> None:
    """Log lines ``<time> <level> <logger> <message>`` at INFO (DEBUG with ``verbose``); httpx's
    one line per request only from WARNING up (agents and the bridge would drown the useful lines)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
