"""The bridge's state file and its tombstones (apiary.tracking.ledger), without Prefect."""

from __future__ import annotations

import json

from apiary.tracking.ledger import Ledger


def _finish(ledger: Ledger, job_id: str, seq: int, run: str) -> None:
    job = ledger.job(job_id)
    job.update(flowRunId=run, lastSeq=seq, done=True, final={"type": "COMPLETED", "name": "Completed"})
    ledger.cursor = max(ledger.cursor, seq)


def test_pruned_jobs_leave_the_state_file_and_are_appended_once_to_the_tombstones(tmp_path):
    path = tmp_path / "b.json"
    ledger = Ledger(path)
    live = ledger.job("ann~live")
    live.update(flowRunId="run-live", lastSeq=1)
    ledger.save()
    size_live_only = path.stat().st_size
    for i in range(300):
        _finish(ledger, f"ann~{i}", i + 2, f"run-{i}")
    ledger.prune()
    ledger.save()
    ledger.save()  # nothing new: nothing appended again

    state = json.loads(path.read_text())
    assert list(state["jobs"]) == ["ann~live"] and state["cursor"] == 301
    assert path.stat().st_size == size_live_only + len("301") - len("0")  # the cursor grew, nothing else
    lines = (tmp_path / "b.json.tombs").read_text().splitlines()
    assert len(lines) == 300
    assert json.loads(lines[7]) == ["ann~7", {"flowRunId": "run-7", "lastSeq": 9, "done": True, "owned": True,
                                             "final": {"type": "COMPLETED", "name": "Completed"}}]

    again = Ledger(path)  # a restarted bridge
    assert again.job("ann~7")["done"] is True and again.job("ann~7")["flowRunId"] == "run-7"
    assert "ann~7" not in again.jobs and again.job("ann~7") is again.tombs["ann~7"]
    assert again.by_flow_run()["run-7"] == [("ann~7", again.tombs["ann~7"])]
    assert again.by_flow_run()["run-live"] == [("ann~live", again.jobs["ann~live"])]
    assert "nobody~x" not in again.jobs and "nobody~x" not in again.tombs


def test_a_record_in_the_state_file_wins_over_a_tombstone_appended_before_a_stop(tmp_path):
    path = tmp_path / "b.json"
    ledger = Ledger(path)
    ledger.job("bo~a").update(flowRunId="run-a", lastSeq=3, running=True)
    ledger.cursor = 3
    ledger.save()
    # The bridge appended bo~a's tombstone and stopped before it replaced the state file.
    (tmp_path / "b.json.tombs").write_text(json.dumps(["bo~a", {"flowRunId": "run-a", "lastSeq": 4, "done": True}])
                                          + "\n")
    again = Ledger(path)
    assert again.job("bo~a")["running"] is True and not again.job("bo~a")["done"]  # its events are done again
    assert again.tombs == {}
    assert (tmp_path / "b.json.tombs").read_text() == ""  # the stale tombstone is gone from the file too


def test_a_torn_last_tombstone_is_skipped_and_the_file_rewritten_whole(tmp_path):
    path = tmp_path / "b.json"
    ledger = Ledger(path)
    _finish(ledger, "cy~1", 1, "run-1")
    ledger.prune()
    ledger.save()
    tombs = tmp_path / "b.json.tombs"
    tombs.write_text(tombs.read_text() + '["cy~2", {"flowRu')  # a stop mid-append
    again = Ledger(path)
    assert set(again.tombs) == {"cy~1"}
    _finish(again, "cy~3", 3, "run-3")
    again.prune()
    again.save()
    assert [json.loads(line)[0] for line in tombs.read_text().splitlines()] == ["cy~1", "cy~3"]


def test_tombstones_an_older_state_file_kept_among_its_jobs_move_to_the_tombstones_file(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"version": 2, "cursor": 9, "jobs": {
        "di~old": {"flowRunId": "run-old", "lastSeq": 9, "done": True, "owned": True, "final": None},
        "di~live": {"flowRunId": "run-live", "lastSeq": 8, "done": False, "inst": {}, "open": {}},
    }}))
    ledger = Ledger(path)
    assert set(ledger.jobs) == {"di~live"} and set(ledger.tombs) == {"di~old"}
    ledger.save()
    assert set(json.loads(path.read_text())["jobs"]) == {"di~live"}
    assert Ledger(path).tombs["di~old"]["flowRunId"] == "run-old"
