"""Auto's one ladder (core/memory_policy.py): the three places a pool's precision is chosen (a new
pool, memory pressure, a full pool) walk it in the same order, and a precision asked for by name
never moves."""
from kvchat.core.config import LADDER, ORDER, Precision
from kvchat.core.kv_sizes import KVShape, bytes_per_token
from kvchat.core.memory_policy import MemoryPolicy, Preempt, StepDown, estimate_weights

SHAPE = KVShape(num_layers=30, num_kv_heads=3, head_dim=64)  # the starter's
PER_TOKEN = {p: bytes_per_token(SHAPE, p, 4) for p in ORDER}


def start_walk(policy: MemoryPolicy) -> list[Precision]:
    """A new pool for 4,096 tokens in less and less memory: the precision it starts at each time."""
    seen = []
    for budget in range(int(PER_TOKEN[Precision.FP16] * 4096), 0, -1 << 16):
        p = policy.start(lambda q: PER_TOKEN[q] * 4096 <= budget)
        if p not in seen:
            seen.append(p)
    return seen


def pressure_walk(policy: MemoryPolicy) -> list[Precision]:
    """A pool of 4,096 tokens in use under a context of 8,192, shrunk again and again: the precision
    it steps to each time, from where it is."""
    seen, current = [], policy.rungs()[0]
    for allowed in range(int(PER_TOKEN[Precision.FP16] * 8192), 0, -1 << 16):
        choice = policy.under_pressure(current, lambda q: int(allowed // PER_TOKEN[q]), 4096, 8192)
        if choice is None:
            break
        current = choice
        if choice not in seen:
            seen.append(choice)
    return seen


def full_walk(policy: MemoryPolicy) -> list[Precision]:
    """A pool that fills again after each step down, until a request is preempted."""
    seen = [policy.rungs()[0]]
    while isinstance(step := policy.when_full(seen[-1], rings_full=False, whole_layers=True), StepDown):
        seen.append(step.precision)
    return seen


def test_auto_walks_one_ladder_from_each_entry():
    auto = MemoryPolicy(Precision.AUTO)
    walks = {"start": start_walk(auto), "pressure": pressure_walk(auto), "full": full_walk(auto)}
    assert walks == {name: list(LADDER) for name in walks}
    assert LADDER == (Precision.FP16, Precision.INT8, Precision.K8V4, Precision.INT4)


def test_a_precision_asked_by_name_and_a_shape_that_cannot_be_quantized_never_move():
    for requested in (Precision.INT8, Precision.FP8):
        named = MemoryPolicy(requested)
        assert start_walk(named) == pressure_walk(named) == full_walk(named) == [requested]
    plain = MemoryPolicy(Precision.AUTO, quantizable=False)
    assert start_walk(plain) == pressure_walk(plain) == full_walk(plain) == [Precision.FP16]


def test_a_full_pool_preempts_where_a_lower_precision_adds_no_token():
    auto = MemoryPolicy(Precision.AUTO)
    assert auto.when_full(Precision.FP16, rings_full=False, whole_layers=True) == StepDown(Precision.INT8)
    assert auto.when_full(Precision.FP16, rings_full=True, whole_layers=True) == Preempt()  # the rings are full
    assert auto.when_full(Precision.FP16, rings_full=False, whole_layers=False) == Preempt()  # all in rings
    assert auto.when_full(Precision.INT4, rings_full=False, whole_layers=True) == Preempt()  # the bottom


def test_pressure_keeps_the_context_where_a_rung_can_else_takes_the_most_room():
    auto = MemoryPolicy(Precision.AUTO)
    # the bytes of 6,000 fp16 tokens (fp32 on the CPU): int8 holds the 8,192 asked for
    allowed = PER_TOKEN[Precision.FP16] * 6000
    assert auto.under_pressure(Precision.FP16, lambda q: int(allowed // PER_TOKEN[q]), 4096, 8192) == Precision.INT8
    # of 1,000: none holds 8,192; k8v4 and int4 hold the 4,096 in use, int4 the most; none 8,000
    allowed = PER_TOKEN[Precision.FP16] * 1000
    assert [int(allowed // PER_TOKEN[q]) for q in LADDER] == [1000, 3764, 4923, 6400]
    assert auto.under_pressure(Precision.FP16, lambda q: int(allowed // PER_TOKEN[q]), 4096, 8192) == Precision.INT4
    assert auto.under_pressure(Precision.FP16, lambda q: int(allowed // PER_TOKEN[q]), 8000, 8192) is None


def test_the_estimate_assumes_the_weights_auto_chose_for_the_loaded_model():
    assert estimate_weights("auto", on_cuda=False) == "int8"  # before anything is measured
    assert estimate_weights("auto", on_cuda=False, chosen="int4") == "int4"  # measured fastest here
    assert estimate_weights("auto", on_cuda=False, chosen="float32") == "fp32"
    assert estimate_weights("auto", on_cuda=True) == "bf16"
    assert estimate_weights("none", on_cuda=False) == "fp32" and estimate_weights("int4", on_cuda=False) == "int4"
    assert estimate_weights("nf4", on_cuda=True) == "nf4" and estimate_weights("int8", on_cuda=True) == "int8"
