import os
import tempfile

# Before anything imports torch, transformers, triton or Qt.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU, checked against the reference
os.environ.setdefault("KVCHAT_DECODE", "eager")  # tests of the compiled step ask for it by name
os.environ["KVCHAT_HOME"] = os.environ.get("KVCHAT_TEST_HOME") or tempfile.mkdtemp(prefix="kvchat-test-")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def starter():
    """The starter model, loaded once (converted once per test session into KVCHAT_HOME)."""
    from kvchat.engine.models import load

    return load("starter")


@pytest.fixture(scope="session")
def tokenizer(starter):
    return starter.tokenizer
