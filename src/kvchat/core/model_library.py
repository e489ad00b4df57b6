"""Models already on this machine, and whether each fits here, from its config alone (nothing loads):
the Hugging Face hub cache, LM Studio's models folder, kvchat's own models folder and folders the
user adds. A model is a folder with a config.json and safetensors, or a .gguf file. A hub id is
fetched into the hub cache with progress and cancel."""
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvchat.core.gguf_header import Array, Header, read_header
from kvchat.core.config import LADDER, Precision
from kvchat.core.kv_sizes import config_value
from kvchat.core.memory import GiB, plan
from kvchat.core.paths import data_dir

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

GGUF_KEYS = {  # config.json name: the GGUF metadata key after "<architecture>."
    "num_hidden_layers": "block_count", "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
    # the true head size where it is not hidden / heads (Qwen3 below 8B, Gemma): without it the
    # planner gave Qwen3-0.6B's KV at half its size
    "head_dim": "attention.key_length"}
# as transformers' GGUF loader reads a file (integrations/ggml.py): Gemma's windows, and Gemma 3's
# GGUF is its text model
GGUF_WINDOWED = ("gemma2", "gemma3")
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}


@dataclass
class LocalModel:
    path: str
    source: str  # hub cache | LM Studio | kvchat | added | picked
    name: str
    architecture: str
    parameters: int | None
    file_bytes: int
    trained_context: int | None
    config: dict = field(repr=False, default_factory=dict)
    quantization: str = "?"  # the weights' format on disk: Q4_1, bf16, 4-bit (bitsandbytes)...


def default_roots() -> list[tuple[Path, str]]:
    hub = os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    return [(Path(hub), "hub cache"), (Path.home() / ".lmstudio" / "models", "LM Studio"),
            (Path.home() / ".cache" / "lm-studio" / "models", "LM Studio"), (data_dir() / "models", "kvchat")]


def scan(extra: list[str] = (), roots: list[tuple[Path, str]] | None = None) -> list[LocalModel]:
    found, seen = [], set()
    for root, source in (roots if roots is not None else default_roots()) + [(Path(p), "added") for p in extra]:
        for path in candidates(root):
            key = path.resolve()
            if key in seen:
                continue
            seen.add(key)
            model = describe(path, source)
            if model is not None:
                found.append(model)
    return found


def candidates(root: Path, depth: int = 5):
    """Model folders (a config.json beside weights) and .gguf files, a few levels deep."""
    if not root.is_dir():
        return
    for folder, dirs, files in os.walk(root, followlinks=True):
        here = Path(folder)
        if len(here.relative_to(root).parts) >= depth:
            dirs.clear()
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "blobs"]
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            yield here
        for f in files:
            if f.endswith(".gguf") and "mmproj" not in f:
                yield here / f


def describe(path: Path, source: str = "picked") -> LocalModel | None:
    try:
        return describe_gguf(path, source) if path.suffix == ".gguf" else describe_folder(path, source)
    except (OSError, ValueError, KeyError) as e:  # unreadable or not a model: left out of the list
        return LocalModel(str(path), source, path.name, f"unreadable: {e}", None, 0, None) if path.suffix == ".gguf" else None


def describe_folder(folder: Path, source: str) -> LocalModel:
    config = json.loads((folder / "config.json").read_text())
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    name = folder.name
    if folder.parent.name == "snapshots":  # hub cache: models--org--name/snapshots/<revision>
        name = folder.parent.parent.name.removeprefix("models--").replace("--", "/")
    from kvchat.core.memory import parameter_counts

    try:
        parameters = sum(parameter_counts(config))
    except (TypeError, KeyError):
        parameters = None
    return LocalModel(str(folder), source, name, config.get("model_type", "?"), parameters, size,
                      config_value(config, "max_position_embeddings"), config, folder_quantization(config))


def folder_quantization(config: dict) -> str:
    """What a config.json says of its weights: a quantization method and bits, else its dtype."""
    q = config.get("quantization_config") or {}
    if q:
        bits = q.get("bits") or (4 if q.get("load_in_4bit") else 8 if q.get("load_in_8bit") else None)
        method = q.get("quant_method", "quantized")
        return f"{bits}-bit ({method})" if bits else str(method)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "?")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


def gguf_quantization(file_type) -> str:
    """GGUF's general.file_type as llama.cpp names it (MOSTLY_Q4_1 -> Q4_1)."""
    from gguf import LlamaFileType

    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (ValueError, TypeError):
        return "?"


def describe_gguf(path: Path, source: str) -> LocalModel:
    header = read_header(path)
    config = gguf_config(header)
    # the file's name, as the user saw it in the folder (general.name is often a training run's id)
    return LocalModel(str(path), source, path.stem, config["model_type"], sum(header.tensors.values()),
                      path.stat().st_size, config.get("max_position_embeddings"), config,
                      gguf_quantization(header.metadata.get("general.file_type")))


def gguf_config(header: Header) -> dict:
    """The config.json keys the planner reads, from a GGUF's header (an array field: None)."""
    meta = header.metadata
    arch = meta.get("general.architecture", "?")
    config = {key: meta.get(f"{arch}.{gguf_key}") for key, gguf_key in GGUF_KEYS.items()}
    config = {key: None if isinstance(value, Array) else value for key, value in config.items()}
    tokens = meta.get("tokenizer.ggml.tokens")
    config.update(model_type=GGUF_MODEL_TYPES.get(arch, arch), vocab_size=tokens.count if isinstance(tokens, Array) else None,
                  tie_word_embeddings="output.weight" not in header.tensors)
    if arch in GGUF_WINDOWED:
        config["sliding_window"] = meta.get(f"{arch}.attention.sliding_window")
    return config


@dataclass
class Fit:
    """Whether a model fits here, as a badge (``kind``: fits, kv, weights, too-large, unknown), its
    words, and the largest context per KV precision behind it."""
    kind: str
    label: str
    weights: str = ""  # the weight format planned with
    max_context: dict = field(default_factory=dict)

    def tooltip(self, trained: int | None) -> str:
        if not self.max_context:
            return self.label
        rows = []
        for name, tokens in self.max_context.items():
            capped = trained is not None and tokens > trained
            rows.append(f"KV {name}: {min(tokens, trained) if capped else tokens:,} tokens"
                        + (" (the model's trained limit)" if capped else ""))
        return f"Largest context on this machine with {self.weights} weights:\n" + "\n".join(rows)


def int4_weights_bytes(config) -> int:
    """Weight-only int4 (torch's packed CPU kernels): half a byte a weight plus a group scale."""
    from kvchat.core.memory import parameter_counts

    linear, other = parameter_counts(config)
    return int(linear * (0.5 + 2 / 32) + other * 2)


def fit(model: LocalModel, memory: int, on_cuda: bool, headroom: int = GiB, want: int = 32768) -> Fit:
    """The planner's badge for this machine: "fits" at full-precision KV, "fits at int8 KV" (or
    lower) with a quantized KV cache, "needs 4-bit weights", or "too large", for the model's trained
    context up to ``want`` tokens; at least 2,048 tokens count as fitting with the lowest KV."""
    if model.parameters is None or not config_value(model.config, "num_hidden_layers"):
        return Fit("unknown", "unknown (no config to plan from)")
    trained = model.trained_context or want
    goal = min(trained, want)
    formats = [("bf16", None), ("nf4", None)] if on_cuda else [("int8", None), ("int4", int4_weights_bytes)]
    first = None
    for i, (weights, size) in enumerate(formats):
        try:
            p = plan(model.config, memory, goal, weights, headroom, kv_full_bytes=2 if on_cuda else 4,
                     weights_size=size(model.config) if size else None)
        except (TypeError, KeyError, ZeroDivisionError):
            return Fit("unknown", "unknown (incomplete config)")
        first = first or Fit("too-large", "too large", weights, p.max_context)
        holds = [(name, tokens) for name, tokens in p.max_context.items() if tokens >= goal and Precision(name) in LADDER]
        if not holds and p.max_context["int4"] >= 2048:
            holds = [("int4", p.max_context["int4"])]
        if not holds:
            continue
        name, tokens = holds[0]
        context = f"{min(tokens, trained) // 1024}k"
        if i == 1:
            return Fit("weights", f"needs 4-bit weights · {context}", weights, p.max_context)
        if name == next(iter(p.max_context)):
            return Fit("fits", f"fits · {context}", weights, p.max_context)
        return Fit("kv", f"fits at {name} KV · {context}", weights, p.max_context)
    return first


def verdict(model: LocalModel, memory: int, on_cuda: bool, headroom: int = GiB, want: int = 32768) -> str:
    """The badge's words: "fits · 8k", "fits at int8 KV · 32k", "needs 4-bit weights · 32k", "too large"."""
    return fit(model, memory, on_cuda, headroom, want).label


def hub_id_problem(text: str) -> str | None:
    """Why ``text`` is not a Hugging Face model id (org/name), or None."""
    text = text.strip()
    if HUB_ID.fullmatch(text):
        return None
    example = "org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct"
    return f"{text} is not a Hugging Face model id: type {example}" if text else f"Type a Hugging Face model id: {example}"


def fetch(repo_id: str, progress, cancelled: threading.Event) -> LocalModel:
    """Download ``repo_id`` into the hub cache, the files the engine's load would fetch, and describe
    it. ``progress(done, total)`` in bytes; setting ``cancelled`` stops it at the next chunk. Raises
    the models module's ModelError with one line (offline, not found, cancelled)."""
    from kvchat.core.model_source import ModelError, download

    def report(done: int, total: int) -> None:
        if cancelled.is_set():
            raise ModelError(f"download of {repo_id} cancelled")
        progress(done, total)

    folder = download(repo_id.strip(), report)
    try:
        return describe_folder(folder, "hub cache")
    except (OSError, ValueError) as e:
        raise ModelError(f"{repo_id} downloaded, but it is not a model kvchat can read: {e}") from None
