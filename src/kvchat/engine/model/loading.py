"""Model sources (HF folder, .gguf, hub id, the starter) resolved and loaded with transformers."""
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvchat.core.model_source import SUPPORTED, ModelError, ModelSource, download, resolve
from kvchat.core.errors import first_line
from kvchat.core.paths import cache_dir
from kvchat.engine.model.weights import quantize_linears

log = logging.getLogger("kvchat.models")
@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    source: ModelSource
    identity: str  # names the weights: keys the prefix cache and the persisted KV
    device: torch.device
    dtype: torch.dtype


def gguf_file_config(location: str | Path):
    """A GGUF's model config as transformers reads it from the header, for planning (a config.json
    needs no torch: ``model_source.plain_config``)."""
    from transformers import AutoConfig

    path = Path(location)
    try:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:
        raise ModelError(f"cannot read GGUF file {path}: {first_line(e)}") from None


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("device cuda was asked for, but no CUDA GPU is available")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


DIGESTS_KEPT = 64


def file_digest(path: Path) -> str:
    """The file's sha256, remembered by its path, inode, size and times: hashing the starter's
    138 MB took 0.13 s of every start. The change time moves whenever the file is written, even
    by a copy that keeps the modification time (``cp -p``)."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
    memo = cache_dir() / "digests.json"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = None
    known = known if isinstance(known, dict) else {}
    if isinstance(known.get(key), str):
        return known[key]
    known.pop(key, None)
    digest = sha256_of(path)
    known = dict(list(known.items())[-(DIGESTS_KEPT - 1):]) | {key: digest}
    try:
        partial = memo.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(known))
        partial.replace(memo)  # whole or not at all: two starts at once read a complete file
    except OSError:  # a read-only cache: the next start hashes again
        pass
    return digest


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_identity(folder: Path, revision: str = "") -> str:
    """Config plus each weight file's name and size: cheap for 15 GB of weights, and it changes
    whenever the weights are replaced by others."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    h.update(revision.encode())
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def load(spec: str, device: str = "auto", dtype: str = "auto", weights: str = "none",
         progress: Callable[[int, int, str], None] | None = None, decode: str = "auto") -> LoadedModel:
    """``progress(done, total, stage)``: stage "download" counts bytes; a GGUF's first conversion
    goes through "read" (parsing the file), "tokenizer" and "model" (transformers building them),
    all with total 0 (no count to give), then "convert" counts its tensors; "weights" counts the
    tensors loaded. Raising in it stops the load there."""
    source = resolve(spec)
    dev = pick_device(device)
    if dev.type == "cuda":
        from kvchat.engine import toolchain

        toolchain.configure()  # Triton builds its kernels' launchers with it on a machine without cc
    asked, weights = weights, pick_weights(weights, dev, decode)
    staged = (lambda stage: (lambda done, total: progress(done, total, stage))) if progress else (lambda stage: None)
    if source.kind in ("gguf", "starter"):
        digest = file_digest(Path(source.location))
        folder = gguf_to_folder(Path(source.location), digest, progress)
        identity = "gguf:" + digest
    elif source.kind == "hub":
        folder = download(source.location, staged("download"))
        identity = "hub:" + folder_identity(folder, revision=folder.name)
    else:
        folder = Path(source.location)
        identity = "folder:" + folder_identity(folder)
    why = None
    if asked == "auto" and dev.type == "cpu":
        weights, why = _measured_weights(folder, source, decode)
    torch_dtype = torch.bfloat16 if weights == "bf16" else pick_dtype(dtype, dev)
    model, tokenizer = _load_folder(folder, dev, torch_dtype, weights, source, staged("weights"))
    # what "auto" chose, for the window's chip: the weights in memory, or the dtype they stay in
    model.config.kvchat_weights = weights if weights != "none" else str(torch_dtype).removeprefix("torch.")
    model.config.kvchat_weights_why = why
    if weights != "none":  # other weights give other K/V: the prefix cache must not mix them
        identity += f"|weights:{weights}"
    return LoadedModel(model, tokenizer, source, identity, dev, torch_dtype)


def _compiles(decode: str) -> bool:
    from kvchat.engine.compile_env import cpu_compile_missing

    return decode != "eager" and cpu_compile_missing() is None


def pick_weights(weights: str, device: torch.device, decode: str = "auto") -> str:
    """``auto`` before the model's shapes are known: int8 on the CPU when the decode step compiles
    and the int8 kernel runs here; the checkpoint's own weights on CUDA. ``load`` then measures
    (``weight_speed``)."""
    if weights == "auto":
        from kvchat.kernels import int8_rows

        return "int8" if device.type == "cpu" and _compiles(decode) and int8_rows.cpu_supported() else "none"
    if device.type == "cpu" and weights == "nf4":
        raise ModelError("nf4 weights need a CUDA GPU (bitsandbytes); on the CPU use none, bf16, int8 or int4")
    return weights


def _measured_weights(folder: Path, source, decode: str) -> tuple[str, str | None]:
    """Auto on the CPU: the weight mode whose products run fastest here for this model's shapes
    (``weight_speed``), and why; the rule of ``pick_weights`` where the config cannot be read."""
    from transformers import AutoConfig

    from kvchat.engine.model.weight_speed import choose

    try:
        config = AutoConfig.from_pretrained(folder)
        return choose(config, _compiles(decode), four_bit=_stored_in_four_bits(source))
    except Exception as e:  # noqa: BLE001 - timing is a refinement: the rule below always answers
        log.warning("weights not timed for %s (%s): the default rule instead", source.label, first_line(e))
        return pick_weights("auto", torch.device("cpu"), decode), None


# GGUF's general.file_type of checkpoints whose weights are all 4-bit groups of 32 with a scale (and
# a minimum): Q4_0, Q4_1. Q4_K files keep some tensors at 5 or 6 bits, which int4 would round.
FOUR_BIT_FILE_TYPES = {2, 3}


def _stored_in_four_bits(source) -> bool:
    if source.kind not in ("gguf", "starter"):
        return False
    from kvchat.core.gguf_header import read_header

    try:
        return read_header(Path(source.location)).metadata.get("general.file_type") in FOUR_BIT_FILE_TYPES
    except (OSError, ValueError):
        return False


def gguf_to_folder(path: Path, digest: str, progress: Callable[[int, int, str], None] | None = None) -> Path:
    """transformers dequantizes a GGUF on every load (10-15 s for the starter); convert it once to
    safetensors in the cache dir, keyed by the file's hash, and load that afterwards. A conversion
    found damaged (cut short on disk) is deleted and made again. ``progress(done, total, stage)``
    as ``load`` says: "read", "tokenizer", "model", then "convert" tensor by tensor."""
    folder = cache_dir() / "converted" / digest[:32]
    if (folder / "done").is_file():
        problem = converted_problem(folder)
        if problem is None:
            return folder
        log.warning("the converted model in %s is damaged (%s): converting %s again", folder, problem, path.name)
        shutil.rmtree(folder, ignore_errors=True)
    _convert_gguf(path, folder, progress or (lambda done, total, stage: None))
    return folder


def _convert_gguf(path: Path, folder: Path, progress: Callable[[int, int, str], None]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvchat.engine.model.gguf import converting

    # the starter: ~2.5 s parsing, ~1.3 s the tokenizer, ~1.9 s the model before its tensors count
    progress(0, 0, "read")
    try:
        with converting(path, lambda done, total: progress(done, total, "convert")):
            progress(0, 0, "tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            progress(0, 0, "model")
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except ModelError:  # the load was cancelled from the progress callback
        raise
    except Exception as e:  # gguf raises ValueError, struct.error, KeyError... on a bad file
        raise ModelError(f"cannot read GGUF file {path}: {first_line(e)}") from None
    folder.mkdir(parents=True, exist_ok=True)
    save_plain(model, folder)
    tokenizer.save_pretrained(folder)
    size = (folder / "model.safetensors").stat().st_size
    (folder / "done").write_text(json.dumps({"source": str(path), "size": size}))


def converted_problem(folder: Path) -> str | None:
    """Why a finished conversion cannot be trusted, or None: the weights file must have the size
    written when it was made, and a header that safetensors accepts (it checks the offsets
    against the file's length, so a cut file fails)."""
    from safetensors import SafetensorError, safe_open

    weights = folder / "model.safetensors"
    try:
        expected = json.loads((folder / "done").read_text()).get("size")
        size = weights.stat().st_size
        if expected is not None and size != expected:
            return f"model.safetensors is {size:,} bytes, {expected:,} were written"
        with safe_open(weights, "pt") as f:
            f.keys()
    except (OSError, ValueError, SafetensorError) as e:
        return first_line(e)
    return None


def save_plain(model, folder: Path) -> None:
    """save_pretrained refuses a GGUF-loaded model; its weights are plain tensors once dequantized."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})


def _load_folder(folder: Path, device, dtype, weights, source, progress=None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvchat.engine.model.gguf import weights_counted

    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as e:
        raise ModelError(f"cannot read the model config in {source.label}: {first_line(e)}") from None
    kwargs = {"dtype": dtype}
    model_class = AutoModelForCausalLM
    if config.model_type == "gemma3":  # Gemma 3 from 4B: images and text; kvchat runs the text part
        config, model_class, kwargs["key_mapping"] = _text_part_of_gemma3(config)
        kwargs["config"] = config
    if config.model_type not in SUPPORTED:
        raise ModelError(f"{source.label}: architecture {config.model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")
    cpu_quant = device.type == "cpu" and weights in ("int8", "int4")
    if weights not in ("none", "bf16") and not cpu_quant:
        kwargs["quantization_config"] = _bnb_config(weights, device, dtype)
    if device.type == "cuda":  # straight to the GPU: a CPU copy first would need the whole model in RAM
        kwargs["device_map"] = {"": device.index or 0}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        with weights_counted(progress):
            model = model_class.from_pretrained(folder, **kwargs)
    except ModelError:  # the load was cancelled from the progress callback
        raise
    except Exception as e:
        raise ModelError(f"cannot load {source.label}: {first_line(e)}") from None
    if device.type != "cuda":
        model.to(device)
    model.config.kvchat_parameter_count = _parameter_count(config)
    if cpu_quant:
        try:
            quantize_linears(model, weights)
        except ValueError as e:
            raise ModelError(f"{source.label}: {e}") from None
    return model.eval(), tokenizer


def _text_part_of_gemma3(config):
    """The language model of a multimodal Gemma 3 checkpoint: its text config (the end-of-turn ids
    are the wrapper's), the text class, and the renaming of its weights (the vision tower's are
    left unread). Checkpoints name them ``language_model.model.*`` (the hub's) or, saved by a newer
    transformers, ``model.language_model.*``."""
    from transformers import Gemma3ForCausalLM

    text = config.text_config
    for name in ("eos_token_id", "quantization_config"):  # a pre-quantized checkpoint says so at the top
        if getattr(config, name, None) is not None:
            setattr(text, name, getattr(config, name))
    mapping = {r"^language_model\.model\.": "model.", r"^model\.language_model\.": "model.",
               r"^language_model\.lm_head\.": "lm_head."}
    return text, Gemma3ForCausalLM, mapping


def _parameter_count(config) -> int | None:
    """The checkpoint's parameters, a tied embedding once, as the model library counts them. Kept
    on the loaded config because int8/int4 weights give a tied head its own copy and untie the
    config, which then counted the embedding twice (163M for the 135M starter)."""
    from kvchat.core.memory import parameter_counts

    try:
        return sum(parameter_counts(config))
    except (TypeError, KeyError, AttributeError):  # a config the planner cannot read: no count
        return None


def _bnb_config(weights: str, device, dtype: torch.dtype):
    if device.type != "cuda":
        raise ModelError(f"{weights} weights need a CUDA GPU (bitsandbytes); on the CPU use none, bf16, int8 or int4")
    from transformers import BitsAndBytesConfig

    if weights == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    # computes in the model's dtype: fp16 on a GPU without bf16, as the rest of the model runs
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
