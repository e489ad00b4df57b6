import os
import shutil
import tempfile

# Before anything imports torch, transformers, triton or Qt.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU, checked against the reference
os.environ.setdefault("KVCHAT_DECODE", "eager")  # tests of the compiled step ask for it by name
# a fresh home per run, removed at the end: each holds a converted starter and compiled code (~550 MB)
_OWN_HOME = None if os.environ.get("KVCHAT_TEST_HOME") else tempfile.mkdtemp(prefix="kvchat-test-")
os.environ["KVCHAT_HOME"] = os.environ.get("KVCHAT_TEST_HOME") or _OWN_HOME

import pytest  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    if _OWN_HOME:
        shutil.rmtree(_OWN_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def starter():
    """The starter model, loaded once (converted once per test session into KVCHAT_HOME)."""
    from kvchat.engine.model.loading import load

    return load("starter")


@pytest.fixture(scope="session")
def tokenizer(starter):
    return starter.tokenizer
