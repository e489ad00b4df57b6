"""A keyring for tests, so that nothing touches the machine's real one: in memory, or in a JSON file
named by KVCHAT_TEST_KEYRING (a ``kvchat`` subprocess picks it with PYTHON_KEYRING_BACKEND)."""
import json
import os
from pathlib import Path

import keyring.backend


class MemoryKeyring(keyring.backend.KeyringBackend):
    priority = 1

    def __init__(self):
        super().__init__()
        self.store = {}

    def set_password(self, service, username, password):
        self.store[service, username] = password

    def get_password(self, service, username):
        return self.store.get((service, username))

    def delete_password(self, service, username):
        self.store.pop((service, username), None)


class FileKeyring(keyring.backend.KeyringBackend):
    """Kept across processes: one CLI call saves a key, the next one reads it."""
    priority = 1

    @property
    def path(self) -> Path:
        return Path(os.environ["KVCHAT_TEST_KEYRING"])

    def _read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def set_password(self, service, username, password):
        self.path.write_text(json.dumps({**self._read(), f"{service}/{username}": password}))

    def get_password(self, service, username):
        return self._read().get(f"{service}/{username}")

    def delete_password(self, service, username):
        rows = self._read()
        rows.pop(f"{service}/{username}", None)
        self.path.write_text(json.dumps(rows))
