"""The command line's checks that need no model: run before one loads (seconds to minutes), each
failure one line (a ConfigError), never a traceback."""
import os
import sys
from pathlib import Path

from kvchat.core.config import MAX_RUNNING, ConfigError


def looks_like_path(model: str) -> bool:
    """A model named by a path (not 'starter', not a hub id such as Org/Name)."""
    return model.startswith((".", "/", "~")) or model.endswith((".gguf", ".json")) or os.sep + os.sep in model


def check_engine_args(args) -> None:
    """What can be told before a model loads: one line each, never a traceback."""
    if args.context < 1:
        raise ConfigError(f"--context must be a positive number of tokens, not {args.context}")
    if args.threads is not None:
        cores = os.cpu_count() or 1
        if args.threads < 1:
            raise ConfigError(f"threads must be a positive integer, not {args.threads}")
        if args.threads > cores:  # more threads than cores only contend (10,000 started 20,003 and hung)
            print(f"kvchat: --threads {args.threads} capped at {cores}, this machine's core count", file=sys.stderr)
            args.threads = cores
    model = getattr(args, "model", None)
    if model and not getattr(args, "remote", None) and looks_like_path(model):
        path = os.path.expanduser(model)
        if not os.path.exists(path):
            raise ConfigError(f"no such model file or folder: {model}")
        if path.endswith(".gguf") and os.path.isfile(path):
            from kvchat.core.gguf_header import read_header

            try:  # a cut or foreign file, told before torch and transformers load (seconds)
                read_header(Path(path))
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot read GGUF file {model}: {e}") from None


def check_serve_args(args) -> None:
    """The server's own arguments, checked before the model loads (it takes seconds to minutes)."""
    import socket

    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 1..65535, not {args.port}")
    if args.max_queue < 1:
        raise ConfigError(f"--max-queue must be positive, not {args.max_queue}")
    if not 1 <= args.max_running <= MAX_RUNNING:
        raise ConfigError(f"--max-running must be in 1..{MAX_RUNNING}, not {args.max_running}")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key (or $KVCHAT_API_KEY) is empty, which would serve without a key; "
                          "leave it out to serve without one")
    for origin in args.cors_origin:
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest.rstrip("/") or "*" in origin:
            raise ConfigError(f"--cors-origin takes an origin such as http://localhost:3000, not {origin!r}")
    for name in args.allow_host:
        if not name.strip() or any(c in name for c in "/ @"):
            raise ConfigError(f"--allow-host takes a host name, not {name!r}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host {args.host}: not an address of this machine ({e})") from None
    with socket.socket(family, kind, proto) as probe:  # the port taken, or an address not ours: say so now
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"cannot serve on {args.host}:{args.port}: {e.strerror or e}") from None


def print_capped(requested: int):
    """A listener that says, once the model is ready, when --context was capped at its trained
    length (the engine's own notice comes before a listener can be added)."""
    def on_event(event) -> None:
        from kvchat.core.events import ModelReady

        if isinstance(event, ModelReady) and event.settings.get("max_context", requested) < requested:
            print(f"kvchat: --context {requested:,} capped at {event.settings['max_context']:,} tokens, the length "
                  "the model was trained for (--allow-long-context lets it pass)", file=sys.stderr)
    return on_event


def quiet_transformers() -> None:
    """transformers' warnings and progress bars off: called once a command's arguments passed,
    since importing it takes seconds."""
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass
