"""Read the server's own command line: start-up decisions are made from ``sys.argv`` (which
multiprocessing hands to spawned API servers too), before or without vLLM's parsed arguments."""

from __future__ import annotations

from collections.abc import Sequence


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The last value given for any of ``names`` (``--flag value`` or ``--flag=value``)."""
    value = None
    for index, arg in enumerate(argv):
        for name in names:
            if arg == name and index + 1 < len(argv):
                value = argv[index + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def flag_values(argv: Sequence[str], name: str) -> list[str]:
    """Every value given for a repeatable flag such as ``--middleware``."""
    values = []
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            values.append(argv[index + 1])
        elif arg.startswith(name + "="):
            values.append(arg.split("=", 1)[1])
    return values


def is_server_command(argv: Sequence[str]) -> bool:
    return "serve" in argv or any(arg.endswith("api_server") for arg in argv)


def model_arg(argv: Sequence[str]) -> str | None:
    model = flag_value(argv, "--model")
    if model is None and "serve" in argv:
        index = list(argv).index("serve") + 1
        if index < len(argv) and not argv[index].startswith("-"):
            model = argv[index]
    return model
