"""The test session's start ledger: each server started is one JSON line (what it served, how
long it took to answer ``/health``), so the run can say what its starts cost and by which test
(tests/conftest.py prints the summary). Unset, as outside the test session, nothing is written."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Sequence

from .models.helper_settings import HelperSettings

#: a JSON-lines file each started server is recorded in (the test session's start ledger:
#: tests/conftest.py prints what the starts cost, by test group)
SERVER_LEDGER_ENV = HelperSettings.variable("server_ledger")


def record_start(model_dir: Path, parser: str, extra_args: Sequence[str], vanilla: bool,
                 one_flag: bool, seconds: float) -> None:
    settings = HelperSettings.from_environ()   # read now: the ledger and the test change
    ledger = settings.server_ledger
    if ledger is None:
        return
    record = {"test": (settings.pytest_current_test or "").split(" ")[0],
              "model": Path(model_dir).name, "parser": parser, "vanilla": vanilla,
              "one_flag": one_flag, "args": list(extra_args), "seconds": round(seconds, 1)}
    with contextlib.suppress(OSError), open(ledger, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
