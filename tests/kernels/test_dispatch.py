"""What dispatch hands the CUDA kernels of a step: each row's length and window bounds as a device
tensor, copied from the host once per row a step, not once per row and layer."""
import torch

from kvchat.kernels import dispatch


def test_a_batchs_rows_copy_their_values_once_a_step_not_once_a_layer(monkeypatch):
    made = []
    real = torch.tensor

    def counting(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "_STEP", {})
    monkeypatch.setattr(torch, "tensor", counting)
    for step in range(3):
        lengths = [100 + 37 * row + step for row in range(8)]
        for _layer in range(32):  # the eager batch's attention asks per layer, row after row
            got = [dispatch._step_tensor("lens", (n,), "cpu") for n in lengths]
            assert [int(t) for t in got] == lengths and all(t.dtype == torch.int32 for t in got)
        assert len(made) == 8 * (step + 1)  # before: 8 x 32 copies a step, as the rows alternated


def test_the_kept_values_are_bounded():
    dispatch._STEP.pop(("test", "cpu"), None)
    first = dispatch._step_tensor("test", (0,), "cpu")
    for n in range(1, dispatch.STEP_TENSORS):
        dispatch._step_tensor("test", (n,), "cpu")
    assert dispatch._step_tensor("test", (0,), "cpu") is first  # still among the newest (and now the newest)
    for n in range(dispatch.STEP_TENSORS, 2 * dispatch.STEP_TENSORS):
        dispatch._step_tensor("test", (n,), "cpu")
    assert len(dispatch._STEP[("test", "cpu")]) == dispatch.STEP_TENSORS
    assert dispatch._step_tensor("test", (0,), "cpu") is not first  # dropped, made again
    dispatch._STEP.pop(("test", "cpu"))
