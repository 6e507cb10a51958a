"""Hardening of the approvals subsystem: each test here failed before its fix.

* hints: a malformed or contradictory tool-definition ``approval`` object is a 400 before generation;
* the grant store's files are private and principals are keyed with a per-store secret;
* ``purge --older-than-days`` refuses negative ages;
* rules that require approval match a tool's bare name inside any namespace.
"""

from __future__ import annotations

import pytest

from vllm_allowed_tools.approvals import cli as approvals_cli
from vllm_allowed_tools.approvals import open_store

# ------------------------------------------------------------------------- cli: purge ages


@pytest.mark.parametrize("days", ["-1", "-0.5", "nan", "inf", "soon"])
def test_purge_refuses_negative_or_non_finite_ages(tmp_path, capsys, days):
    db = tmp_path / "grants.db"
    open_store(db).close()
    with pytest.raises(SystemExit) as info:
        approvals_cli.main(["--db", str(db), "purge", "--older-than-days", days])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--older-than-days" in err and "number of days >= 0" in err and repr(days) in err


def test_purge_accepts_zero_days(tmp_path, capsys):
    db = tmp_path / "grants.db"
    open_store(db).close()
    assert approvals_cli.main(["--db", str(db), "purge", "--older-than-days", "0"]) == 0
    assert "removed 0 rows" in capsys.readouterr().out
