"""Rounding in Triton as torch rounds, for the kernels whose stores must match the reference's bits."""
import triton
import triton.language as tl


@triton.jit
def round_even(x):
    """Round half to even, as torch.round does."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r / 2.0)) == 1.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def to_bf16(x):
    """fp32 -> bf16 rounded to nearest, ties to even, as torch casts (finite values only). The
    interpreter's own cast rounds otherwise, so the tests could not hold it to torch's bits; spelled
    out in integers, the kernel under test is the kernel a GPU runs."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
