"""Starting and stopping the suite's ``vllm-allowed-tools serve-tiny`` servers, and loading the
repository's scripts as modules: what conftest's session fixtures and the test modules that start
servers of their own share. ``_RUNNING`` lists the servers started and not yet stopped; conftest
stops what is left at the end of the session (the list object itself, imported there)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from vllm_allowed_tools.devtools.serve import ServeTinyProcess, start_serve_tiny

#: the repository's root (examples/, benchmarks/ are folders of it)
ROOT = Path(__file__).resolve().parent.parent.parent

_RUNNING: list[ServeTinyProcess] = []


def start_cli_server(flavour: str, extra_args: list[str] | None = None,
                     timeout: float = 900.0, options: list[str] | None = None,
                     env: dict[str, str] | None = None) -> ServeTinyProcess:
    """Start `vllm-allowed-tools serve-tiny` (builds the model on first use) and wait for its URL;
    ServeError says why it did not come up."""
    server = start_serve_tiny(flavour, options=options or (), extra_args=extra_args or (), env=env,
                              timeout=timeout)
    _RUNNING.append(server)
    return server


def stop_cli_server(server: ServeTinyProcess) -> None:
    server.stop()
    if server in _RUNNING:
        _RUNNING.remove(server)


def load_script(folder: str, name: str):
    """`folder/name.py` of the repository (examples/, benchmarks/: scripts, not a package) as a
    module, once per session; its folder is importable, as when the script runs."""
    module_name = f"{folder}_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    directory = ROOT / folder
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    spec = importlib.util.spec_from_file_location(module_name, directory / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module   # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module
