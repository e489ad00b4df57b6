"""Plain words for the engine's terms, with the expert term kept for a tooltip: the KV cache's
precision is "memory saving", a weight format is named with what it does."""
from kvchat.core.memory_policy import DTYPE_FORMATS

SAVING = {"auto": "automatic", "fp16": "off", "int8": "moderate", "fp8": "moderate, GPU", "k8v4": "strong",
          "int4": "maximum"}
SAVING_HELP = {"auto": "kvchat picks the least saving that holds the context you asked for, and saves more "
                       "when memory gets short",
               "fp16": "the KV cache at full precision (fp16; fp32 on the CPU)",
               "int8": "KV cache in 8 bits: half the memory, answers as good in kvchat's tests",
               "fp8": "KV cache in 8-bit floats (fp8): half the memory, a little below int8's quality; "
                      "GPUs from the RTX 40 series on read it in hardware",
               "k8v4": "keys in 8 bits, values in 4: about a third of the memory",
               "int4": "KV cache in 4 bits: a quarter of the memory, for the longest contexts"}
WEIGHTS = {"auto": "automatic", "none": "as stored", "bf16": "bf16", "int8": "8-bit", "int4": "4-bit", "nf4": "4-bit (nf4)"}


def saving(precision: str) -> str:
    return SAVING.get(precision, precision)


def saving_tip(setting: str, in_force: str | None) -> str:
    """The expert term behind the chip: the setting and the KV precision in force."""
    now = in_force or setting
    head = f"KV: {now}" + (" (chosen automatically)" if setting == "auto" else "")
    return f"{head}. Memory saving: {SAVING_HELP.get(setting, setting)}. Click to change."


def weights_label(setting: str, chosen: str | None) -> str:
    """"8-bit weights (auto)": what the setting says and, under auto, what auto chose."""
    chosen = DTYPE_FORMATS.get(chosen, chosen) if chosen else None
    if setting == "auto":
        return f"{WEIGHTS.get(chosen, chosen)} weights (auto)" if chosen else "weights: automatic"
    if setting == "none":
        return f"{chosen} weights" if chosen else "weights as stored"
    return f"{WEIGHTS.get(setting, setting)} weights"
