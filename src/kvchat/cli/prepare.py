"""``kvchat prepare``: compile now, into this user's cache, what a first start compiles in the
background: the int8 kernel (then Auto times the weight modes), the int8 weights' fused paths,
and the decode step's graph for the fp16 pool and the one shared by the quantized pools. `make
run`'s set-up and the packaged app's install.sh run it once, so that a first start is what `bench
startup` calls warm: full speed in seconds, not minutes.

It compiles for this machine (its vector units, its compiler), which is why a package cannot
carry the result. Nothing waits for it: a start before it ended compiles in the background as
usual, and both find the other's files in inductor's cache."""
import sys

from kvchat.core.config import EngineConfig


def prepare(model: str = "starter", out=sys.stdout) -> dict:
    """The graphs a first start of the app compiles (the app's defaults): seconds per stage. The
    int8 kernel is built first, so that Auto times the weight modes here (``weight_speed``) and
    every later start finds the answer."""
    from kvchat.engine.model.kernel_build import build_kernel
    from kvchat.engine.precompile import compile_for

    build_kernel()
    return compile_for(EngineConfig(model=model, kv_precision="auto", weights="auto"), ("fp16", "int8"), out)
