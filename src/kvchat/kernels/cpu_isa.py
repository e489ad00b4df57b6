"""Which x86-64 instruction set kvchat's CPU kernels use: the best this CPU runs, or an override.

Most desktops have no AVX-512: Intel's Core of the 12th to 14th generation and Core Ultra have
AVX-VNNI on 256-bit registers, AMD's Zen 2 and 3 AVX2 only. ``KVCHAT_CPU_ISA`` (``avx2``,
``avx_vnni`` or ``avx512_vnni``) picks a lesser one on a machine that runs more, so that what
those users get can be run and measured anywhere; set ``ATEN_CPU_CAPABILITY=avx2`` beside it for
torch and inductor. Without kvchat's variable, torch's is followed: ``avx2`` caps kvchat at the
256-bit kernels, ``default`` (no vector code) runs none.
"""
import functools
import os

import torch

# best last; the index is the kernel's ``isa`` argument (int8_rows.cpp)
ISAS = ("avx2", "avx_vnni", "avx512_vnni")
_NEEDS = {
    "avx2": ("avx2", "fma3"),
    "avx_vnni": ("avx2", "fma3", "avx_vnni"),
    "avx512_vnni": ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_vnni", "fma3"),
}
OVERRIDE = "KVCHAT_CPU_ISA"


@functools.cache
def _capabilities() -> dict:
    get = getattr(torch.cpu, "get_capabilities", None)  # torch 2.11 and later
    return get() if get is not None else {}


def runs(isa: str) -> bool:
    """Can this CPU execute ``isa``'s kernel?"""
    caps = _capabilities()
    return all(caps.get(flag, False) for flag in _NEEDS[isa])


def available() -> list[str]:
    """The ISAs this CPU executes, best last: what the tests run the kernels under."""
    return [isa for isa in ISAS if runs(isa)]


def override_problem() -> str | None:
    """What is wrong with ``KVCHAT_CPU_ISA`` here, in one line; None when it is unset or usable."""
    wanted = os.environ.get(OVERRIDE, "").strip().lower()
    if not wanted:
        return None
    if wanted not in ISAS:
        return f"{OVERRIDE}={wanted} is not one of {', '.join(ISAS)}"
    if not runs(wanted):
        return f"{OVERRIDE}={wanted}: this CPU cannot run it (it runs {', '.join(available()) or 'none of them'})"
    return None


def chosen() -> str | None:
    """The ISA the kernels run now (read each call: a test or a bench may change the override),
    or None where none runs here."""
    wanted = os.environ.get(OVERRIDE, "").strip().lower()
    if wanted:
        return wanted if override_problem() is None else None
    usable = available()
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten == "default":
        return None
    if aten == "avx2":
        usable = [isa for isa in usable if isa != "avx512_vnni"]
    return usable[-1] if usable else None


def describe() -> dict:
    """The instruction sets in play, for a bench's report: kvchat's kernels, ATen's, inductor's."""
    info = {"kvchat": chosen() or "none", "aten": torch.backends.cpu.get_cpu_capability()}
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        info["inductor"] = str(pick_vec_isa()) or "none"
    except Exception:  # noqa: BLE001 - a torch without it: leave it out
        pass
    return info
