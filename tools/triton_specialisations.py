"""pytest plugin: the Triton kernels a test session would compile on a GPU, counted on the CPU.

On a GPU each distinct (kernel, specialisation, launch options) is one compile of several seconds,
serial, inside gpu-check's kernel step. Under TRITON_INTERPRET=1 nothing compiles, so every launch
is bound here with Triton's own binder for sm_90 (``create_function_from_signature`` over the
kernel's parameters, as ``JITFunction.run`` keys its cache: constexpr values, argument types,
integers' ==1 and divisibility by 16, pointers' alignment) and the keys are kept per test. Written
as JSON to $KVCHAT_SPECIALISATIONS when the session ends: ``{test: [[kernel, key, constexprs], ...]}``
(``constexprs``: a JSON object of the launch's constexpr arguments by name)."""
import inspect
import json
import os

_per_test: dict[str, set] = {}
_current = ["(outside a test)"]
_binders = {}


def _binder(fn):
    if fn not in _binders:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import KernelParam, create_function_from_signature

        sig = inspect.signature(fn.fn)
        skip = fn.kwargs.get("do_not_specialize") or ()
        names = list(sig.parameters)
        skip = {names[d] if isinstance(d, int) else d for d in skip}
        params = [KernelParam(i, p, p.name in skip, False) for i, p in enumerate(sig.parameters.values())]
        _binders[fn] = create_function_from_signature(sig, params, CUDABackend(GPUTarget("cuda", 90, 32)))
    return _binders[fn]


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") != "1" or not os.environ.get("KVCHAT_SPECIALISATIONS"):
        return
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        launch = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        constexprs = {k: v for k, v in kwargs.items() if k not in launch}
        _, specialization, _ = _binder(self)(*args, **constexprs)
        key = repr((specialization, sorted(launch.items())))
        named = json.dumps({k: v if isinstance(v, (bool, int, float, str)) else str(v)
                            for k, v in sorted(constexprs.items())})
        _per_test.setdefault(_current[0], set()).add((self.fn.__name__, key, named))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = counted


def pytest_runtest_setup(item):
    _current[0] = item.nodeid


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KVCHAT_SPECIALISATIONS")
    if path and os.environ.get("TRITON_INTERPRET") == "1":
        with open(path, "w") as f:
            json.dump({test: sorted(map(list, keys)) for test, keys in _per_test.items()}, f)
