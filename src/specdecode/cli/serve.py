"""`specdecode serve`: the OpenAI-compatible server (`register` adds it to the CLI's parser).

It binds 127.0.0.1 unless told otherwise. With --api-key (repeatable, `LABEL=KEY` to label a
key's traffic; or SPECDECODE_API_KEY, one key taken as it is) every request but /health (/v1/*,
/metrics, /openapi.json) needs `Authorization: Bearer KEY`. `--record FILE` appends every
request accepted to FILE as a workload line (server.record: prompts are user data). Every check
that can fail on the user's input runs before the model loads; a taken port is one error line,
not a traceback.
The server's packages (the `server` extra) are imported only when `serve` runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.cli.args import add_drafter_args, add_model_args, add_rule_arg, drafter_options
from specdecode.errors import SpecDecodeError
from specdecode.limits import SUFFIX_ISOLATION
from specdecode.limits import SUFFIX_STORE_MIB as SUFFIX_MIB
from specdecode.limits import SUFFIX_STORE_REQUESTS as SUFFIX_REQUESTS

if TYPE_CHECKING:
    from specdecode.server.middleware import ApiKey
    from specdecode.server.record import RecordOptions
    from specdecode.server.state import ServeOptions

API_KEY_ENV = "SPECDECODE_API_KEY"
SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")
SERVE_MAX_STEP_COST = 1.5
HEADER_TIMEOUT_S = 10.0  # = specdecode.server.connections.HEADER_TIMEOUT_S
BODY_TIMEOUT_S = 60.0  # = specdecode.server.state.BODY_TIMEOUT_S
SHUTDOWN_TIMEOUT_S = 30.0  # = specdecode.server.shutdown.SHUTDOWN_TIMEOUT_S
DEFAULT_MAX_MIB = 256.0  # = specdecode.server.record.DEFAULT_MAX_MIB
DEFAULT_KEEP = 3  # = specdecode.server.record.DEFAULT_KEEP
WINDOW_S = 60.0  # = specdecode.server.speculation.WINDOW_S


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
    p.add_argument("--api-key", action="append", default=None, metavar="[LABEL=]KEY",
                   help="require Authorization: Bearer KEY; repeatable, one key per client "
                        "group; LABEL names its traffic in the speculation metrics and the "
                        "recording (=KEY: no label, for a key holding '='; default: "
                        f"${API_KEY_ENV} if set, one key taken as it is)")
    p.add_argument("--record", type=Path, default=None, metavar="FILE",
                   help="append every request accepted to FILE as a workload line (the body "
                        "as received, its arrival time, its key's label, never the key; its "
                        "output's length and finish reason) for `bench --workload FILE "
                        "--arrivals recorded`; prompts are user data (FILE is created 0600)")
    p.add_argument("--record-outputs", action="store_true",
                   help="--record: keep the outputs' text too")
    p.add_argument("--record-max-mib", type=float, default=DEFAULT_MAX_MIB,
                   help="--record: rotate FILE past this size (FILE.1, FILE.2, ...; default "
                        f"{DEFAULT_MAX_MIB:g})")
    p.add_argument("--record-keep", type=int, default=DEFAULT_KEEP,
                   help=f"--record: rotated parts kept (default {DEFAULT_KEEP})")
    p.add_argument("--speculation-window", type=float, default=WINDOW_S,
                   help="seconds over which the live speculation metrics judge whether "
                        f"speculation pays (GET /v1/speculation; default {WINDOW_S:g})")
    p.add_argument("--calibration", type=Path, default=None, metavar="REPORT",
                   help="the bench report.json (or its run folder) this deployment was chosen "
                        "by: a target, precision or drafter that differs from it is a warning "
                        "and a gauge (re-measure after every target swap)")
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
        api_keys=api_keys(args.api_key),
        served_model_name=args.served_model_name,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        max_prompt_bytes=args.max_prompt_bytes,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
        shutdown_timeout=args.shutdown_timeout, rule=args.rule,
        record=record_options(args), speculation_window=args.speculation_window,
        calibration=args.calibration,
    )
    options.check()
    return options


def api_keys(values: list[str] | None) -> tuple[ApiKey, ...]:
    """--api-key values ([LABEL=]KEY each), else $SPECDECODE_API_KEY (taken as it is)."""
    from specdecode.server.middleware import ApiKey

    if values:
        return tuple(ApiKey.parse(v) for v in values)
    env = os.environ.get(API_KEY_ENV)
    return (ApiKey(env),) if env else ()


def record_options(args: argparse.Namespace) -> RecordOptions | None:
    """--record and its companions; the companions without --record are refused."""
    from specdecode.server.record import RecordOptions

    if args.record is None:
        if args.record_outputs:
            raise SpecDecodeError("--record-outputs needs --record FILE")
        return None
    if not math.isfinite(args.record_max_mib):
        raise SpecDecodeError(f"--record-max-mib must be finite, got {args.record_max_mib}")
    return RecordOptions(args.record, outputs=args.record_outputs,
                         max_bytes=int(args.record_max_mib * 2**20), keep=args.record_keep)


def check_installed() -> None:
    """Raise a one-line error naming the install command when the server extra is missing."""
    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise SpecDecodeError(f"specdecode serve needs {', '.join(missing)}: "
                              "pip install 'specdecode[server]'")


def cmd_serve(args: argparse.Namespace) -> int:
    check_installed()
    from specdecode.models.backends import load_model
    from specdecode.models.kernels import release_openmp_threads
    from specdecode.server.app import create_app
    from specdecode.server.background import bind_socket, uvicorn_server
    from specdecode.server.shutdown import drain
    from specdecode.server.state import build_state

    options = options_from_args(args)
    sock = bind_socket(args.host, args.port)
    if not _is_loopback(args.host) and not options.api_keys:
        print(f"specdecode: warning: listening on {args.host} without an API key",
              file=sys.stderr)
    loaded = load_model(args.model, args.precision, args.backend, max_batch=args.max_batch)
    state = build_state(loaded, options)
    # Every step runs on the engine thread from now on: the OpenMP team this thread kept from
    # loading and calibrating would slow each of them (kernels.release_openmp_threads).
    release_openmp_threads()
    host, port = sock.getsockname()[:2]
    store = ""
    factory = state.served.make_drafter
    if factory is not None and factory.store is not None:  # say whose text drafts come from
        store = (f", store of earlier requests {factory.store.max_bytes / 2**20:g} MiB / "
                 f"{factory.store.max_requests} requests, isolation {factory.isolation}")
    if options.api_keys:
        labels = sorted({k.label or "(none)" for k in options.api_keys})
        print(f"specdecode: {len(options.api_keys)} API key(s), labels {', '.join(labels)}",
              file=sys.stderr)
    if options.record is not None:
        print(f"specdecode: recording every request accepted to {options.record.path} "
              f"(outputs {'kept' if options.record.outputs else 'not kept'}; prompts are user "
              "data)", file=sys.stderr)
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
