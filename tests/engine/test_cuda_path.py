"""The CUDA code path on the CPU: dispatch told it is on CUDA, the Triton kernels run by the
interpreter (TRITON_INTERPRET=1). Its logits against the reference path, and its host overhead:
the ops a decode step dispatches per layer, which on a GPU are launches the CPU must issue. With
the interpreter off (``make gpu-check``) the same tests run on CUDA tensors."""
import contextlib
import os
from collections import Counter
from unittest import mock

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvchat.engine.kv.block_pool import BlockPool
from kvchat.engine.kv.cache import KVCache
from kvchat.core.kv_sizes import KVShape
from kvchat.engine.kv.manager import KVCacheManager, Sequence
from kvchat.engine.model.runner import ModelRunner
from kvchat.kernels import dispatch, triton_decode, triton_int4, triton_kv

from tiny_models import tiny_model

pytestmark = pytest.mark.gpu  # runs on CUDA where there is one: make gpu-check's kernel step

# compiled kernels take CUDA pointers only; without CUDA and the interpreter, conftest skips these
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

NO_LAUNCH = {"view", "_unsafe_view", "transpose", "unsqueeze", "squeeze", "slice", "select", "expand", "t",
             "as_strided", "permute", "alias", "detach", "detach_", "unflatten", "flatten", "reshape", "lift_fresh",
             "empty", "empty_like", "empty_strided", "to"}  # views, allocations, casts of what already has the dtype


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").to(DEVICE)


def runner_at(model, precision: str, prompt: int = 40):
    shape = KVShape.from_config(model.config)
    kv = KVCache(shape, 64, 16, torch.float32, DEVICE, precision)
    if kv.format.quantized:
        gen = torch.Generator().manual_seed(3)
        stats = (torch.randn(shape.num_kv_heads, shape.head_dim, generator=gen) * 0.1,
                 torch.rand(shape.num_kv_heads, shape.head_dim, generator=gen) + 0.5,
                 torch.rand(2, shape.num_kv_heads, generator=gen) * 0.05 + 0.01)
        kv.calibrated(*([t.to(DEVICE)] * shape.num_layers for t in stats))
    manager = KVCacheManager(BlockPool(64), 16, "test")
    runner = ModelRunner(model, kv, manager, "eager")
    seq = Sequence(list(range(3, 3 + prompt)))
    manager.reserve(seq, prompt)
    return runner, manager, seq


def on_cuda_path():
    return mock.patch.object(dispatch, "use_triton", lambda *args: True)


@pytest.mark.parametrize("precision", ["fp16", "fp8", "int4"])
def test_the_cuda_path_decodes_as_the_reference_does(model, precision):
    """Prefill and three decode steps, the window's ring written by the write kernel and read by
    the decode kernel, against the pure-torch path."""
    logits = {}
    for cuda in (False, True):
        runner, manager, seq = runner_at(model, precision)
        with mock.patch.object(dispatch, "use_triton", lambda *args: cuda):
            runner.forward(seq, len(seq), want_logits=False)
            steps = []
            for token in (7, 11, 13):
                seq.token_ids.append(token)
                manager.reserve(seq, len(seq))
                steps.append(runner.forward(seq, len(seq), want_logits=True))
        logits[cuda] = torch.stack(steps)
    assert (logits[True] - logits[False]).abs().max() < 1e-4


class Launch:
    """A Triton kernel stubbed out: one dispatch, no work."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        def run(*args, **constants):
            with torch.profiler.record_function("aten::triton_" + self.name):
                pass
        return run


@contextlib.contextmanager
def stubbed_kernels():
    with mock.patch.object(triton_kv, "_quantize_write_kernel", Launch("write")), \
            mock.patch.object(triton_int4, "_block_keys_kernel", Launch("write")), \
            mock.patch.object(triton_decode, "_paged_decode_kernel", Launch("decode")), \
            mock.patch.object(triton_decode, "_merge_kernel", Launch("merge")):
        yield


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_a_decode_step_launches_at_most_20_ops_per_layer_for_attention(model, precision):
    """int4 with its window took 42 launching ops a layer (the window transformed twice, split and
    merged in torch); 15 with the merge in torch, fewer with the merge in a kernel, the Triton
    kernels included."""
    runner, manager, seq = runner_at(model, precision)
    runner.forward(seq, len(seq), want_logits=False)
    seq.token_ids.append(7)
    manager.reserve(seq, len(seq))
    with on_cuda_path(), stubbed_kernels(), torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.forward(seq, len(seq), want_logits=True)
    ops = Counter(e.name[len("aten::"):] for e in prof.events() if e.name.startswith("aten::") and inside_attention(e))
    launches = sum(n for name, n in ops.items() if name not in NO_LAUNCH) / model.config.num_hidden_layers
    assert ops["triton_decode"] == ops["triton_merge"] == ops["triton_write"] / 2 == model.config.num_hidden_layers
    assert launches <= 20, ops


def inside_attention(event) -> bool:
    """Called by the attention op itself, not nested in another aten op."""
    parent, inside = event.cpu_parent, False
    while parent is not None:
        if parent.name.startswith("kvchat::"):
            inside = True
        elif parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return inside


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_a_decode_step_makes_no_tensor_from_host_values(model, precision):
    """On a GPU each tensor made from Python values is a copy from pageable memory, which waits for
    the GPU: a decode step made three (the runner's slot and block table, the length), four with a
    window. Now the step's values go in by fills and the block table by its new ids, so only the
    first step of a sequence may copy (its table, unless the step's buffer holds those ids), and an eager step with a window its bounds (a
    captured one copies them from pinned memory, without waiting)."""
    runner, manager, seq = runner_at(model, precision)
    made = []
    # the kernels stubbed: the interpreter's own tensors are not the host copies a GPU would make
    with on_cuda_path(), stubbed_kernels(), torch.inference_mode():
        runner.forward(seq, len(seq), want_logits=False)
        for token in range(7, 17):  # 40 -> 50 tokens: a new block at 48
            seq.token_ids.append(token)
            manager.reserve(seq, len(seq))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                runner.forward(seq, len(seq), want_logits=True)
            made.append(sum(e.name == "aten::lift_fresh" for e in prof.events()))
    window = 1 if precision == "int4" else 0
    # the table's ids may be there from before, and a window's bounds (kept by value) from an earlier step
    assert made[0] <= 1 + window and all(n <= window for n in made[1:]), made


def test_the_ram_tier_copies_blocks_out_and_back_exactly_on_the_device():
    """The host tier's copies on the device (on CUDA: into reused pinned buffers on a side stream,
    and back without the host waiting): blocks copied out, their pool rows overwritten by the next
    step, restored into other blocks, read as they were; a released block's buffers serve the next."""
    from kvchat.engine.kv.host_tier import HostTier, copy_in, copy_out

    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=128)
    kv = KVCache(shape, 8, 16, torch.float32, DEVICE, "fp16")
    gen = torch.Generator().manual_seed(5)
    with on_cuda_path():  # the pool's rows as a step writes them: the write kernel on CUDA
        for layer in range(shape.num_layers):
            k, v = (torch.randn(8 * 16, 2, 128, generator=gen).to(DEVICE) for _ in range(2))
            kv.write(layer, k, v, torch.arange(8 * 16, device=DEVICE), None, 0)
    before = [{n: t.clone() for n, t in layer.items()} for layer in kv.layers]
    tier = HostTier(cap_bytes=1 << 20, device=DEVICE)
    stored = [copy_out(kv.layers, b, tier.buffers) for b in (1, 2)]
    for layer in kv.layers:  # the compute stream reuses the blocks at once
        for t in layer.values():
            t[1:3].zero_()
    copy_in(stored, lambda tensors: kv.write_blocks([5, 6], tensors), list(kv.layers[0]), kv.device)
    for layer, old in zip(kv.layers, before):
        for n, t in layer.items():
            assert torch.equal(t[5:7].cpu(), old[n][1:3].cpu())
    stored[0].release()
    again = copy_out(kv.layers, 5, tier.buffers)
    again.wait()
    assert tier.buffers.made == len(kv.layers[0]) * 2  # the first block's buffers, reused
    assert torch.equal(again.tensors["k"][:, 0].to(kv.device), torch.stack([layer["k"][5] for layer in kv.layers]))
