"""Reliability checks against a real server: request fuzzing with an oracle, concurrent load,
client faults, grant-store outages and a SIGKILLed server. ``benchmarks/reliability.py`` runs them
at full size, the end-to-end tests at CI size; what each checks is in benchmarks/README.md."""

from .approval_client import approval_env
from .client_faults import DISCONNECT_BUDGET, run_disconnects
from .fuzz import run_fuzz
from .kill import run_kill, store_check
from .load import rss_growth_problems, run_load
from .report import Figures, approvals_table, table
from .store_outage import postgres_stopped, run_store_outage, sqlite_folder_gone
from .wire import log

__all__ = [
    "DISCONNECT_BUDGET",
    "Figures",
    "approval_env",
    "approvals_table",
    "log",
    "postgres_stopped",
    "rss_growth_problems",
    "run_disconnects",
    "run_fuzz",
    "run_kill",
    "run_load",
    "run_store_outage",
    "sqlite_folder_gone",
    "store_check",
    "table",
]
