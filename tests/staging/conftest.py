"""The end-to-end suite for a platform that is already running: the CI pipeline's integration stage
(apiary.ci.stages.integration) points it at the staging platform it deployed from the commit's
images, through ``APIARY_STAGING_URL`` and ``APIARY_STAGING_TOKEN`` (an admin's token). Without
them (a plain ``make test``) every test here is skipped (test_staging.py's ``pytestmark``): they
need a platform someone else runs.

The staging platform runs Lab 6's two-VC cluster (hived-config-two-vcs.yaml: VC default =
hostname-carol, VC vc1 = hostname-dan) with simulated GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from apiary.client import ApiaryClient


@pytest.fixture(scope="session")
def staging_url() -> str:
    return os.environ["APIARY_STAGING_URL"].rstrip("/")


@pytest.fixture(scope="session")
def admin(staging_url: str) -> Iterator[ApiaryClient]:
    client = ApiaryClient(staging_url, token=os.environ["APIARY_STAGING_TOKEN"], timeout=60)
    yield client
    client.close()
