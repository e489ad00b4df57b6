"""The ``kvchat`` command: chat, generate, serve, bench."""
import argparse
import dataclasses
import json
import logging
import os
import sys
from importlib import metadata

from kvchat.core.config import (DECODE_MODES, DEFAULT_CONTEXT, KV_CHOICES, KV_MODES, MAX_RUNNING, WEIGHTS,
                                ConfigError, EngineConfig, SamplingParams)
from kvchat.cli.bench import bench_args, cmd_bench
from kvchat.cli.checks import check_engine_args, check_serve_args, print_capped, quiet_transformers
from kvchat.cli.connections import cmd_connections, connections_args
from kvchat.core.errors import first_line


USAGE_ERROR = 2


def kvchat_version() -> str:
    try:
        return metadata.version("kvchat")
    except metadata.PackageNotFoundError:  # a source tree on the path, not installed
        return "(not installed)"


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a model folder, a .gguf file, a hub id, or 'starter' (the "
                   "default); with --remote, one of the server's models (default: its first)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--weights", default="auto", choices=list(WEIGHTS),
                   help="auto: int8 on the CPU; CPU: bf16, int8, int4 (torch's kernels); CUDA: int8, nf4 (bitsandbytes)")
    p.add_argument("--decode", default=None, choices=list(DECODE_MODES),
                   help="compiled: inductor on the CPU, CUDA graphs on CUDA (default: auto; eager for "
                        "generate, where a compile costs more than one reply saves)")
    p.add_argument("--kv-precision", default="auto", choices=KV_CHOICES)
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                   help="context length in tokens (capped at the model's trained length)")
    p.add_argument("--allow-long-context", action="store_true",
                   help="let --context pass the model's trained length (answers get worse past it)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--speculate", default="auto", choices=["auto", "off"],
                   help="auto: check tokens proposed from the conversation (and an API client's prediction) "
                        "several at a time, where it pays; off: one token a step")


def remote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote", default=None, metavar="URL",
                   help="an OpenAI-compatible server (vLLM, SGLang, llama-server, kvchat serve) or a saved "
                        "connection's name, instead of the local engine")
    p.add_argument("--api-key", default=os.environ.get("KVCHAT_REMOTE_API_KEY"),
                   help="the server's key (default: $KVCHAT_REMOTE_API_KEY, then the saved connection's)")


def sampling_args(p: argparse.ArgumentParser, max_new: int = 512) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="kvchat", description="Offline chat with local Llama and Qwen models.")
    root.add_argument("--version", action="version", version=f"kvchat {kvchat_version()}")
    sub = root.add_subparsers(dest="command")
    chat = sub.add_parser("chat", help="interactive terminal chat (/system, /reset, /stats, /quit)")
    engine_args(chat)
    sampling_args(chat)
    remote_args(chat)
    chat.add_argument("--system", default=None)
    gen = sub.add_parser("generate", help="one reply to one prompt")
    engine_args(gen)
    sampling_args(gen, max_new=256)
    remote_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", default=None)
    gen.add_argument("--json", action="store_true")
    serve = sub.add_parser("serve", help="OpenAI-compatible API on loopback")
    engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("KVCHAT_API_KEY"),
                       help="require Authorization: Bearer KEY on every route (default: $KVCHAT_API_KEY)")
    serve.add_argument("--allow-host", action="append", default=[],
                       help="a further Host-header name to accept (repeatable); loopback names always are")
    serve.add_argument("--cors-origin", action="append", default=[],
                       help="a browser origin allowed to call the API (repeatable); none by default")
    serve.add_argument("--max-running", type=int, default=EngineConfig.max_running,
                       help=f"requests decoding together, 1..{MAX_RUNNING} (default {EngineConfig.max_running})")
    serve.add_argument("--max-queue", type=int, default=32, help="requests running or waiting before 429")
    bench_args(sub)
    connections_args(sub)
    prep = sub.add_parser("prepare", help="compile the decode step for this machine now, not at the first start")
    prep.add_argument("--model", default="starter")
    pl = sub.add_parser("plan", help="what fits in memory: largest context per KV precision, Auto's pick")
    pl.add_argument("--model", default="starter", help="a folder, a config.json, a .gguf or a hub id")
    pl.add_argument("--context", type=int, required=True)
    pl.add_argument("--memory", default=None, help="device memory to plan for, e.g. 24GiB (default: free now)")
    pl.add_argument("--weights", default="bf16", choices=["bf16", "fp16", "fp32", "int8", "nf4"])
    pl.add_argument("--headroom", default="1GiB")
    pl.add_argument("--json", action="store_true")
    ev = sub.add_parser("eval", help="quality of a quantized KV cache against fp16")
    ev.add_argument("which", choices=["ppl", "kld"])
    ev.add_argument("--model", default="starter")
    ev.add_argument("--text", action="append", default=None,
                    help="a UTF-8 text file (again for more); default: the shipped prose, code, chat and French, "
                         "then the held-out set")
    ev.add_argument("--set", dest="text_set", default="all", choices=["all", "shipped", "held-out"],
                    help="without --text: the shipped texts (tuned on), the held-out ones (never tuned on), or both")
    ev.add_argument("--context", type=int, default=512)
    ev.add_argument("--kv-precision", default="int4", help="one or more of " + ", ".join(KV_MODES) + ", comma-separated")
    ev.add_argument("--weights", default="none", choices=[w for w in WEIGHTS if w != "auto"])
    ev.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the engine's, 512)")
    ev.add_argument("--json", action="store_true")
    return root


def make_config(args) -> EngineConfig:
    decode = args.decode or os.environ.get("KVCHAT_DECODE") or ("eager" if args.command == "generate" else "auto")
    return EngineConfig(model=args.model or "starter", device=args.device, weights=args.weights, decode=decode,
                        kv_precision=args.kv_precision, max_context=args.context, threads=args.threads,
                        allow_long_context=args.allow_long_context, speculate=args.speculate == "auto")


def make_sampling(args) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop)


def start_engine(config: EngineConfig):
    quiet_transformers()  # torch and transformers load in seconds: only once the arguments are good
    from kvchat.engine.engine import Engine

    engine = Engine(config)
    engine.add_listener(print_capped(config.max_context), replay=True)
    engine.wait_ready()
    return engine


def start_backend(args):
    """The local engine, or the server of --remote (a URL or a saved connection's name)."""
    if not args.remote:
        check_engine_args(args)
        return start_engine(make_config(args))
    from kvchat.remote.connect import open_remote

    backend = open_remote(args.remote, api_key=args.api_key, model=args.model)
    backend.wait_ready(timeout=60)
    return backend


def cmd_generate(args) -> int:
    from kvchat.core.events import Request

    sampling = make_sampling(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    from kvchat.engine.chat import ChatError, validate

    try:  # told at once, not after the seconds of loading the model
        validate(messages)
    except ChatError as e:
        raise ConfigError(str(e)) from None
    engine = start_backend(args)
    handle = engine.submit(Request(messages=messages, sampling=sampling))
    if args.json:
        done = handle.result()
        print(json.dumps({"text": done.text, "token_ids": done.token_ids, "finish_reason": done.finish_reason,
                          "stats": vars(done.stats)}, indent=2))
    else:
        done = stream_to_stdout(handle)
    engine.close()
    return 0


def stream_to_stdout(handle):
    from kvchat.core.events import EngineError, Error, Finished, TokenDelta

    from kvchat.core.events import Notice

    for event in handle:
        if isinstance(event, Notice):
            print(f"\n[{event.kind}: {event.message}]", file=sys.stderr)
        elif isinstance(event, TokenDelta):
            print(event.text, end="", flush=True)
        elif isinstance(event, Error):
            print()
            raise EngineError(event.message)
        elif isinstance(event, Finished):
            print()
            return event


def cmd_chat(args) -> int:
    from kvchat.cli.chat_session import ChatSession

    sampling = make_sampling(args)
    print(f"kvchat: {'connecting to ' + args.remote if args.remote else 'loading ' + (args.model or 'starter')} ...",
          file=sys.stderr)
    engine = start_backend(args)
    session = ChatSession(engine, system=args.system)
    print("Type a message; /system TEXT sets the persona, /reset starts over, /stats shows the last turn, "
          "/quit leaves.")
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            break
        if not session.command(line, sampling, stream_to_stdout, print):
            break
    engine.close()
    return 0


def cmd_serve(args) -> int:
    check_engine_args(args)
    check_serve_args(args)
    import uvicorn

    from kvchat.core.events import ModelReady
    from kvchat.serve.server import create_app
    from kvchat.serve.transport import server_config

    engine = start_engine(dataclasses.replace(make_config(args), max_running=args.max_running))
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"kvchat: warning: serving on {args.host}, reachable from other machines", file=sys.stderr)
    ready = []
    engine.add_listener(lambda e: isinstance(e, ModelReady) and ready.append(e), replay=True)
    model_id = engine.loaded.source.api_id if ready and engine.loaded is not None else args.model or "starter"
    app = create_app(engine, model_id, api_key=args.api_key, host=args.host,
                     allow_hosts=tuple(args.allow_host), cors_origins=tuple(args.cors_origin),
                     max_queue=args.max_queue)
    uvicorn.Server(server_config(app, args.host, args.port)).run()
    engine.close()
    return 0


def cmd_prepare(args) -> int:
    from kvchat.cli.prepare import prepare

    done = prepare(args.model)
    print("kvchat prepare: " + ", ".join(f"{k} {v} s" for k, v in done["seconds"].items())
          + "".join(f"; {n}" for n in done["notices"]))
    return 0


def cmd_plan(args) -> int:
    from kvchat.core import memory
    from kvchat.core.config import check_model_config
    from kvchat.core.model_source import SUPPORTED, plain_config, resolve

    try:
        headroom = memory.parse_bytes(args.headroom)
        if args.memory:
            total = memory.parse_bytes(args.memory)
        else:
            from kvchat.engine.memory_probe import MemoryProbe
            from kvchat.engine.model.loading import pick_device

            probe = MemoryProbe(pick_device("auto"))
            size, used = probe.totals()
            total = size - used
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.context <= 0:
        raise ConfigError("--context must be positive")
    try:
        config = plain_config(args.model)
        if config is None:  # a GGUF: transformers (and torch) read its header
            quiet_transformers()
            from kvchat.engine.model.loading import gguf_file_config

            config = gguf_file_config(resolve(args.model).location)
    except ValueError as e:  # JSON that does not parse, a file that is not UTF-8
        raise ConfigError(f"{args.model}: not a readable config.json ({first_line(e)})") from None
    check_model_config(config, args.model, SUPPORTED)
    result = memory.plan(config, total, args.context, args.weights, headroom,
                         kv_full_bytes=4 if args.weights == "fp32" else 2)
    print(json.dumps(result.as_dict(), indent=2) if args.json else memory.format_plan(result))
    return 0


def cmd_eval(args) -> int:
    for text in args.text or ():
        if not os.path.isfile(os.path.expanduser(text)):
            raise ConfigError(f"--text {text}: no such file")
    precisions = [p.strip() for p in args.kv_precision.split(",") if p.strip()]
    wrong = [p for p in precisions if p not in KV_MODES]
    if wrong or not precisions:
        raise ConfigError(f"--kv-precision {args.kv_precision}: choose from {', '.join(KV_MODES)}")
    quiet_transformers()
    from kvchat.bench import evaluate

    evaluate.main(args.which, args.model, args.text, args.context, precisions, args.json, args.weights, args.chunk,
                  args.text_set)
    return 0


def main(argv=None) -> int:
    from kvchat.core.events import EngineError
    from kvchat.core.model_source import ModelError

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="kvchat: %(message)s")
    command = args.command or "chat"
    if command == "prepare":  # the others quiet it once their arguments passed: it imports torch
        quiet_transformers()
    if args.command is None:
        args = parser().parse_args(["chat"])
    try:
        if os.environ.get("KVCHAT_CPU_ISA"):  # torch only where a developer set the override
            from kvchat.kernels.cpu_isa import override_problem

            if (problem := override_problem()) is not None:
                raise ConfigError(problem)
        return {"chat": cmd_chat, "generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench,
                "eval": cmd_eval, "plan": cmd_plan, "prepare": cmd_prepare, "connections": cmd_connections}[command](args)
    except (ModelError, EngineError, ConfigError) as e:
        print(f"kvchat: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
