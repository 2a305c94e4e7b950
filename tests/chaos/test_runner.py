"""The runner without a platform: an experiment chaostoolkit refuses (a rollback calling an action
with an argument it does not take) is a failed verdict saying so, not an exception."""

from __future__ import annotations

import json

import pytest
from tests.chaos.conftest import DATA

from apiary.chaos.runner import run_experiment

pytestmark = pytest.mark.e2e  # runs chaostoolkit, a real program


def test_an_invalid_experiment_is_a_failed_verdict(tmp_path):
    doc = json.loads((DATA / "broken-rollback.json").read_text())
    doc["rollbacks"][0]["provider"]["arguments"] = {"nodes": "hostname-dan"}  # uncordon_node takes `node`
    path = tmp_path / "bad-argument.json"
    path.write_text(json.dumps(doc))
    v = run_experiment(path, api_url="http://127.0.0.1:9", token="t", home=None, journal_dir=tmp_path / "j",
                       timeout_s=120)
    assert not v.passed and v.journal is None and v.exit_code == 1
    assert len(v.reasons) == 1 and v.reasons[0].startswith("chaos exited 1 without a journal")
    assert "required argument 'node' is missing from activity 'uncordon_node'" in v.reasons[0]
    assert v.log.exists()
