"""Names from outside are matched whole: a ``$``-anchored ``re.match`` lets a trailing newline
through (``"alice\\n"``), which then breaks whatever builds a path, an environment or a log line
from the name."""

from __future__ import annotations

import pytest

from apiary.auth.directory import check_name
from apiary.errors import ValidationError
from apiary.incidents.postmortem import _ID
from apiary.runtime.env import _check_name
from apiary.runtime.records import valid_run_id


@pytest.mark.parametrize("bad", ["alice\n", "alice\n\n", "\nalice"])
def test_user_and_group_names_with_a_newline_are_refused(bad: str) -> None:
    assert check_name("username", "alice") == "alice"
    with pytest.raises(ValidationError):
        check_name("username", bad)


def test_environment_names_and_run_ids_with_a_newline_are_refused() -> None:
    _check_name("env", "PAI_TASK_ROLE_train")
    with pytest.raises(ValidationError):
        _check_name("env", "PAI_TASK_ROLE_train\n")
    assert valid_run_id("alice~x.a0.train.0.t0")
    assert not valid_run_id("alice~x.a0.train\n")
    assert _ID.fullmatch("AI-3") and not _ID.fullmatch("AI-3\n")
