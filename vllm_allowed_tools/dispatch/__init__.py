"""The dispatch guard: the application's last check before a tool call runs."""
from .dispatcher import *  # noqa: F401,F403
from .dispatcher import __all__  # noqa: F401
