"""Loading in the fake backend: the model named as the engine names it (core.model_source, so the
same reasons for a model that cannot be found), read from its config alone, with the engine's
progress events (engine/model/loading.py): a hub model's download in bytes; a GGUF's first
conversion ("read", "tokenizer", "model" with no count, then its tensors); then the weights."""
import functools
import json
from pathlib import Path

from kvchat.core.events import LoadProgress
from kvchat.core.gguf_header import read_header
from kvchat.core.model_library import gguf_config as library_gguf_config
from kvchat.core.model_source import SUPPORTED, ModelError, download, resolve

from support.fake_model import STARTER_CONFIG, STARTER_GENERATION, STARTER_LABEL, FakeModel


def load(fake, spec: str, seq: int | None) -> FakeModel:
    """Raising in ``progress`` is how a cancel or a later choice stops a load, as in the engine."""
    def progress(done: int, total: int, stage: str) -> None:
        why = fake.loads.stop_reason(seq)
        if why:
            raise ModelError(why)
        fake.emit(LoadProgress(done, total, stage))

    source = resolve(spec)
    if source.kind == "starter":
        return FakeModel(STARTER_LABEL, STARTER_CONFIG, STARTER_GENERATION)
    if source.kind == "gguf":
        config, tensors = gguf_config(Path(source.location))
        config = dict(config)
        if source.location not in fake.converted:  # converted once, then loaded from the cache
            for stage in ("read", "tokenizer", "model"):
                progress(0, 0, stage)
            for i in range(tensors + 1):
                progress(i, tensors, "convert")
            fake.converted.add(source.location)
        for i in range(1, tensors + 1):
            progress(i, tensors, "weights")
        return FakeModel(source.label, config, STARTER_GENERATION)
    folder = Path(source.location)
    if source.kind == "hub":
        folder = download(source.location, lambda done, total: progress(done, total, "download"))
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read the model config in {source.label}: {e}") from None
    if config.get("model_type") not in SUPPORTED:
        raise ModelError(f"{source.label}: architecture {config.get('model_type')!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")
    progress(1, 1, "weights")
    generation = folder / "generation_config.json"
    return FakeModel(source.label, config, json.loads(generation.read_text()) if generation.is_file() else {})


@functools.lru_cache(maxsize=8)
def gguf_config(path: Path) -> tuple[dict, int]:
    """The config a GGUF's header gives (as the model library reads it) and its tensor count."""
    try:
        header = read_header(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read GGUF file {path}: {e}") from None
    return library_gguf_config(header), len(header.tensors)
