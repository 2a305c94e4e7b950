"""chaos/store-disk-full.json on a platform whose home (SQLite store, logs, agents' state) is a
dedicated 64 MiB tmpfs this fixture mounts (root only), and the refusals that keep the experiment
off every other filesystem."""

from __future__ import annotations

import subprocess

import pytest
from tests.chaos.conftest import is_root, outputs, run_checked, start_platform

from apiary.chaos import disk
from apiary.errors import ValidationError

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    if not is_root():
        pytest.skip("mounting the home's tmpfs needs root")
    home = tmp_path_factory.mktemp("tmpfs-home")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(home)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        p = start_platform(home)
        try:
            yield p
        finally:
            p.stop()
    finally:
        subprocess.run(["umount", "--lazy", str(home)], check=False)


def test_store_disk_full(platform, tmp_path):
    journal = run_checked(platform, "store-disk-full", tmp_path)
    out = outputs(journal)
    assert out["fill-the-store-disk"]["free_bytes"] == 0
    assert out["fill-the-store-disk"]["mount"] == str(platform.home)
    refused_or_kept = out["submit-while-full"]
    assert refused_or_kept["accepted"] or "cannot commit" in refused_or_kept["refused"]
    assert out["free-the-store-disk"]["removed"] == [str(platform.home / disk.FILL_NAME)]
    assert not (platform.home / disk.FILL_NAME).exists()


def test_fill_refuses_anything_but_a_dedicated_small_tmpfs(platform, tmp_path):
    with pytest.raises(ValidationError, match="not a dedicated tmpfs"):
        disk.check_dedicated(tmp_path, tmp_path, max_mb=1024)  # pytest's tmp dir: the real disk
    with pytest.raises(ValidationError, match="outside the platform home"):
        disk.check_dedicated(platform.home, platform.home / "logs", max_mb=1024)
    with pytest.raises(ValidationError, match="larger than max_mb"):
        disk.check_dedicated(platform.home, platform.home, max_mb=8)
    assert disk.check_dedicated(platform.home / "logs", platform.home, max_mb=64).point == platform.home
