"""`specdecode serve`: the OpenAI-compatible server (`register` adds it to the CLI's parser).

It binds 127.0.0.1 unless told otherwise. With --api-key (or SPECDECODE_API_KEY) every request
but /health (/v1/*, /metrics, /openapi.json) needs `Authorization: Bearer KEY`. Every check
that can fail on the user's input runs before the model loads; a taken port is one error line,
not a traceback.
The server's packages (the `server` extra) are imported only when `serve` runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import sys
from typing import TYPE_CHECKING, Any

from specdecode.cli.args import add_drafter_args, add_model_args, add_rule_arg, drafter_options
from specdecode.errors import SpecDecodeError
from specdecode.limits import SUFFIX_ISOLATION
from specdecode.limits import SUFFIX_STORE_MIB as SUFFIX_MIB
from specdecode.limits import SUFFIX_STORE_REQUESTS as SUFFIX_REQUESTS

if TYPE_CHECKING:
    from specdecode.server.state import ServeOptions

API_KEY_ENV = "SPECDECODE_API_KEY"
SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")
SERVE_MAX_STEP_COST = 1.5
HEADER_TIMEOUT_S = 10.0  # = specdecode.server.connections.HEADER_TIMEOUT_S
BODY_TIMEOUT_S = 60.0  # = specdecode.server.state.BODY_TIMEOUT_S
SHUTDOWN_TIMEOUT_S = 30.0  # = specdecode.server.shutdown.SHUTDOWN_TIMEOUT_S


def register(sub: Any) -> None:
    """Add `serve` to the CLI's subparsers (it sets `func`)."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (speculative, batched)")
    add_model_args(p)
    add_drafter_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded together: rows of the shared KV cache (default 8)")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="tokens per cache row: prompt + max_tokens + draft room (default 2048)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests queued beyond --max-batch; more get 429 (default 64)")
    p.add_argument("--api-key", default=None,
                   help=f"require Authorization: Bearer KEY (default: ${API_KEY_ENV} if set)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: its name)")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                   help="seconds a connection has to send a request's complete headers, from "
                        "opening or its last response; then it is closed "
                        f"(default {HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                   help="seconds a request has to send its complete body; then 408 "
                        f"(default {BODY_TIMEOUT_S:g})")
    p.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM/SIGINT: stop admitting (503), give the requests in flight "
                        "this many seconds to finish, then end the rest with an error "
                        f"(default {SHUTDOWN_TIMEOUT_S:g}; a second signal exits at once)")
    p.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="refuse prompt text over this many UTF-8 bytes before tokenizing "
                        "(default: the context window x the vocabulary's longest token in "
                        "bytes, more than any prompt that fits can hold)")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="parse special-token strings (<|im_start|>...) in chat message contents "
                        "as control tokens: only for trusted callers (default: tokenized as "
                        "text, so no user can forge another turn)")
    p.add_argument("--suffix-isolation", choices=SUFFIX_ISOLATION, default=None,
                   help="--drafter suffix: user (default): a request drafts only from earlier "
                        "requests of the same user (the API key presented and the request's "
                        "`user` field), since drafts from another user's text would answer "
                        "faster and so reveal it; shared: from every earlier request (one "
                        "tenant)")
    p.add_argument("--suffix-mib", type=float, default=None,
                   help="--drafter suffix: cap of the store of earlier requests in MiB; the "
                        f"oldest are evicted first (default {SUFFIX_MIB:g})")
    p.add_argument("--suffix-requests", type=int, default=None,
                   help="--drafter suffix: cap of the store in requests (default "
                        f"{SUFFIX_REQUESTS})")
    add_rule_arg(p)
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    # a wide step delays every request in the batch, not only the one whose draft widened it:
    # a cap of 1.5 plain steps cut the inter-token latency's tail at no cost in throughput
    # (docs/measurements/code-figures.md)
    p.set_defaults(func=cmd_serve, max_step_cost=SERVE_MAX_STEP_COST)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from parsed arguments, checked (the drafter's: cli.args.drafter_options)."""
    from specdecode.server.state import ServeOptions

    options = ServeOptions(
        drafter=drafter_options(args),
        max_batch=args.max_batch, max_seq_len=args.max_seq_len, max_queue=args.max_queue,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        served_model_name=args.served_model_name,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        max_prompt_bytes=args.max_prompt_bytes,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
        shutdown_timeout=args.shutdown_timeout, rule=args.rule,
    )
    options.check()
    return options


def check_installed() -> None:
    """Raise a one-line error naming the install command when the server extra is missing."""
    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise SpecDecodeError(f"specdecode serve needs {', '.join(missing)}: "
                              "pip install 'specdecode[server]'")


def cmd_serve(args: argparse.Namespace) -> int:
    check_installed()
    from specdecode.models.loading import load_model
    from specdecode.server.app import create_app
    from specdecode.server.background import bind_socket, uvicorn_server
    from specdecode.server.shutdown import drain
    from specdecode.server.state import build_state

    options = options_from_args(args)
    sock = bind_socket(args.host, args.port)
    if not _is_loopback(args.host) and options.api_key is None:
        print(f"specdecode: warning: listening on {args.host} without an API key",
              file=sys.stderr)
    loaded = load_model(args.model, args.precision, args.backend, max_batch=args.max_batch)
    state = build_state(loaded, options)
    host, port = sock.getsockname()[:2]
    store = ""
    factory = state.served.make_drafter
    if factory is not None and factory.store is not None:  # say whose text drafts come from
        store = (f", store of earlier requests {factory.store.max_bytes / 2**20:g} MiB / "
                 f"{factory.store.max_requests} requests, isolation {factory.isolation}")
    drafter = options.drafter
    print(f"specdecode: serving {state.served.name} at http://{host}:{port}/v1 "
          f"(drafter {drafter.name}, k {drafter.k}{store})", file=sys.stderr)
    server = uvicorn_server(create_app(state), args.log_level,
                            drain=lambda: drain(state, options.shutdown_timeout))
    server.run(sockets=[sock])
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
