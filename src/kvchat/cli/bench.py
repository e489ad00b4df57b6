"""``kvchat bench``: its arguments, checked before anything heavy loads, and which bench runs."""
import os

from kvchat.cli.checks import quiet_transformers
from kvchat.core.config import KV_MODES, MAX_RUNNING, WEIGHTS, ConfigError


# the options each bench reads; one it does not read, given, is refused rather than ignored
READS = {
    "decode": {"model", "random_weights", "device", "dtype", "weights", "kv_precision", "prompt_len", "new_tokens",
               "repeats", "paths"},
    "api": {"model", "remote", "api_key", "clients", "max_tokens"},
    "capped": {"random_weights", "device", "dtype", "memory", "prompts"},
    "startup": {"model"}, "resume": {"model", "kv_precision"}, "prefix": {"model"}, "window": {"random_weights"},
    "speculate": {"model", "clients", "max_tokens", "repeats", "kv_precision"},
    "memory": {"model"}, "switch": {"model"}, "kv": {"model"}, "kernels": {"compile"},
}


def bench_args(sub) -> None:
    bench = sub.add_parser("bench", help="speed and cache benchmarks on the starter model")
    bench.add_argument("which", choices=["decode", "prefix", "kv", "memory", "kernels", "api", "switch", "capped", "startup",
                                         "resume", "window", "speculate", "ui"],
                       help="decode: vs transformers; prefix: cache hits; kv: decode per KV precision; "
                            "capped: long prompts and a downshift on a card of --memory; "
                            "kernels: Triton vs reference on CUDA; switch: memory during a model switch; "
                            "startup: what a new user waits for, from fresh and from warm dirs; "
                            "resume: a long chat answered again after eviction and after a restart (KV tiers); "
                            "window: a windowed model's chat past 2,000 tokens, its windowed layers in rings; "
                            "speculate: replies with speculation off and on (edit, rewrite, open, clients); "
                            "ui: the window's CPU time per streamed token (kvchat bench ui --help)")
    bench.add_argument("--model", default="starter")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--compile", action="store_true",
                       help="kernels: compile every Triton kernel variant for sm_86/89/90 (no GPU needed)")
    api = bench.add_argument_group("api")
    api.add_argument("--remote", default=None, metavar="URL", help="measure this server instead of kvchat serve")
    api.add_argument("--api-key", default=os.environ.get("KVCHAT_REMOTE_API_KEY"))
    api.add_argument("--clients", type=int, default=8, help="the most clients at once (and max running)")
    api.add_argument("--max-tokens", type=int, default=None, help="a reply's most tokens (api: 64, speculate: 256)")
    decode = bench.add_argument_group("decode")
    decode.add_argument("--random-weights", metavar="CONFIG", default=None,
                        help="a config.json (or folder) of the shape to measure, with random weights")
    decode.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    decode.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    decode.add_argument("--weights", default="none", choices=list(WEIGHTS))
    decode.add_argument("--kv-precision", default="fp16", choices=KV_MODES)
    decode.add_argument("--prompt-len", type=int, default=512)
    decode.add_argument("--new-tokens", type=int, default=128)
    decode.add_argument("--repeats", type=int, default=3)
    decode.add_argument("--paths", default="eager,compiled,transformers",
                        help="comma-separated: eager, compiled, transformers")
    decode.add_argument("--memory", default="24GiB", help="capped: the card to emulate")
    decode.add_argument("--prompts", default="16384,32768", help="capped: prompt lengths, comma-separated")
    bench.set_defaults(bench_defaults={a.dest: a.default for a in bench._actions if a.option_strings})


def unread_options(args) -> list[str]:
    """The options given (not at their defaults) that ``args.which`` does not read."""
    reads = READS[args.which] | {"json", "help"}
    return [f"--{dest.replace('_', '-')}" for dest, default in args.bench_defaults.items()
            if dest not in reads and getattr(args, dest) != default]


def cmd_bench(args) -> int:
    if args.which == "ui":  # the launcher runs it before this parser (it needs Qt, this CLI does not)
        raise ConfigError("bench ui runs through the kvchat command: kvchat bench ui")
    unread = unread_options(args)
    if unread:
        raise ConfigError(f"bench {args.which} does not read {', '.join(unread)}; it reads "
                          f"{', '.join('--' + d.replace('_', '-') for d in sorted(READS[args.which])) or 'no option'}"
                          " and --json")
    if args.random_weights and args.model != args.bench_defaults["model"]:
        raise ConfigError("give --model or --random-weights, not both: --random-weights measures random "
                          "weights of that shape and would leave --model unread")
    if args.random_weights and not os.path.exists(os.path.expanduser(args.random_weights)):
        raise ConfigError(f"--random-weights {args.random_weights}: no such file or folder")
    quiet_transformers()
    from kvchat.bench import engine as bench

    if args.which == "decode":
        from kvchat.bench import decode as bench_decode

        paths = [p for p in args.paths.split(",") if p]
        if not paths or set(paths) - set(bench_decode.PATHS):
            raise ConfigError(f"--paths takes a comma-separated subset of {', '.join(bench_decode.PATHS)}")
        if args.prompt_len < 1 or args.new_tokens < 1 or args.repeats < 1:
            raise ConfigError("--prompt-len, --new-tokens and --repeats must be positive")
        bench_decode.report(bench_decode.bench_decode(
            args.model, args.random_weights, args.device, args.dtype, args.weights, args.kv_precision,
            args.prompt_len, args.new_tokens, args.repeats, paths), args.json)
    elif args.which == "api":
        from kvchat.bench import api as bench_api

        args.max_tokens = 64 if args.max_tokens is None else args.max_tokens
        if not 1 <= args.clients <= MAX_RUNNING or args.max_tokens < 1:
            raise ConfigError(f"--clients must be in 1..{MAX_RUNNING} and --max-tokens positive")
        bench_api.report(bench_api.bench_api(args.model, args.remote, args.api_key, None, args.clients,
                                             args.max_tokens), args.json)
    elif args.which == "capped":
        from kvchat.bench import capped as bench_capped
        from kvchat.core.memory import parse_bytes

        if not args.random_weights:
            raise ConfigError("bench capped needs --random-weights CONFIG, e.g. src/kvchat/bench/shapes/llama-3.1-8b.json")
        try:
            prompts = tuple(int(n) for n in args.prompts.split(","))
        except ValueError:
            raise ConfigError(f"--prompts takes comma-separated token counts, not {args.prompts!r}") from None
        result = bench_capped.bench_capped(args.random_weights, args.device, args.dtype, parse_bytes(args.memory),
                                           prompts)
        bench_capped.report(result, args.json)
        return 0 if all(p["ok"] for p in result["phases"]) else 1  # out of memory: the check failed
    elif args.which == "startup":
        from kvchat.bench import startup as bench_startup

        bench_startup.report(bench_startup.bench_startup(args.model), args.json)
    elif args.which == "resume":
        from kvchat.bench import resume as bench_resume

        bench_resume.report(bench_resume.bench_resume(args.model, args.kv_precision), args.json)
    elif args.which == "prefix":
        from kvchat.bench import prefix as bench_prefix

        bench_prefix.report_prefix(bench_prefix.bench_prefix(args.model), args.json)
    elif args.which == "window":
        from kvchat.bench import window as bench_window

        bench_window.report(bench_window.bench_window(args.random_weights), args.json)
    elif args.which == "speculate":
        from kvchat.bench import speculate as bench_speculate

        args.max_tokens = 256 if args.max_tokens is None else args.max_tokens
        if not 1 <= args.clients <= MAX_RUNNING or args.max_tokens < 1 or args.repeats < 1:
            raise ConfigError(f"--clients must be in 1..{MAX_RUNNING}, --max-tokens and --repeats positive")
        bench_speculate.report(bench_speculate.bench_speculate(args.model, args.max_tokens, args.clients,
                                                               args.repeats, args.kv_precision), args.json)
    elif args.which == "memory":
        bench.report_memory(bench.bench_memory(args.model), args.json)
    elif args.which == "switch":
        bench.report_switch(bench.bench_switch(args.model), args.json)
    elif args.which == "kv":
        bench.report_kv(bench.bench_kv(args.model), args.json)
    else:
        from kvchat.bench import kernels as bench_kernels

        bench_kernels.main(args.json, args.compile)
    return 0
