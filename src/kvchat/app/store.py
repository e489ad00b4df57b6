"""Conversations, messages, personas and settings in SQLite (WAL), saved after every change.

A database written by a newer kvchat, or one that SQLite cannot read, is copied aside and reported
with a clear message: never silently replaced.
"""
import json
from contextlib import contextmanager
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from kvchat.app.package_data import ASSETS

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS personas (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, system_prompt TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, persona_id INTEGER REFERENCES personas(id) ON DELETE SET NULL,
    created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL, role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL, token_ids TEXT, stats TEXT, interrupted INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL, UNIQUE (conversation_id, position));
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
DEFAULT_PERSONAS = ASSETS / "personas.json"


class StoreError(RuntimeError):
    """The database cannot be used as it is; the message says why and where the backup went."""


@dataclass
class Message:
    id: int
    position: int
    role: str
    content: str
    token_ids: list[int] | None
    stats: dict | None
    interrupted: bool

    def for_engine(self) -> dict:
        out = {"role": self.role, "content": self.content}
        if self.role == "assistant" and self.token_ids and not self.interrupted:
            out["token_ids"] = self.token_ids
        return out


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._check_version()
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            backup = self._backup("broken")
            raise StoreError(f"the chat database {self.path} is damaged ({e}); a copy was kept at {backup}") from None
        self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        if not self.personas():
            self._seed_personas()

    def _check_version(self) -> None:
        if not self.db.execute("SELECT name FROM sqlite_master WHERE name='meta'").fetchone():
            return
        row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row and int(row[0]) > SCHEMA_VERSION:
            self.db.close()
            backup = self._backup("newer")
            raise StoreError(f"the chat database {self.path} was written by a newer kvchat (schema {row[0]}); "
                             f"update kvchat. A copy was kept at {backup}")

    def _backup(self, why: str) -> Path:
        backup = self.path.with_name(f"{self.path.name}.{why}-{time.strftime('%Y%m%d-%H%M%S')}")
        if self.path.exists():
            shutil.copy2(self.path, backup)
        return backup

    def _seed_personas(self) -> None:
        if DEFAULT_PERSONAS.is_file():
            for p in json.loads(DEFAULT_PERSONAS.read_text()):
                self.add_persona(p["name"], p["system_prompt"])

    def close(self) -> None:
        self.db.close()

    # -- personas --

    def personas(self) -> list[dict]:
        rows = self.db.execute("SELECT id, name, system_prompt FROM personas ORDER BY id").fetchall()
        return [{"id": r[0], "name": r[1], "system_prompt": r[2]} for r in rows]

    def add_persona(self, name: str, system_prompt: str) -> int:
        with _unique_name(name):
            return self.db.execute("INSERT INTO personas (name, system_prompt, created) VALUES (?, ?, ?)",
                                   (name.strip(), system_prompt, time.time())).lastrowid

    def update_persona(self, persona_id: int, name: str, system_prompt: str) -> None:
        with _unique_name(name):
            self.db.execute("UPDATE personas SET name=?, system_prompt=? WHERE id=?",
                            (name.strip(), system_prompt, persona_id))

    def delete_persona(self, persona_id: int) -> None:
        self.db.execute("DELETE FROM personas WHERE id=?", (persona_id,))

    # -- conversations --

    def create_conversation(self, title: str = "New chat", persona_id: int | None = None) -> int:
        now = time.time()
        return self.db.execute("INSERT INTO conversations (title, persona_id, created, updated) VALUES (?, ?, ?, ?)",
                               (title, persona_id, now, now)).lastrowid

    def conversations(self, search: str = "") -> list[dict]:
        query = "SELECT id, title, persona_id, updated FROM conversations"
        args: tuple = ()
        if search:
            query += (" WHERE title LIKE ? OR id IN (SELECT conversation_id FROM messages WHERE content LIKE ?)")
            args = (f"%{search}%", f"%{search}%")
        rows = self.db.execute(query + " ORDER BY updated DESC, id DESC", args).fetchall()
        return [{"id": r[0], "title": r[1], "persona_id": r[2], "updated": r[3]} for r in rows]

    def conversation(self, conversation_id: int) -> dict:
        r = self.db.execute("SELECT id, title, persona_id FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        if r is None:
            raise KeyError(f"no conversation {conversation_id}")
        return {"id": r[0], "title": r[1], "persona_id": r[2]}

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.db.execute("UPDATE conversations SET title=? WHERE id=?", (title.strip() or "Untitled", conversation_id))

    def set_persona(self, conversation_id: int, persona_id: int | None) -> None:
        self.db.execute("UPDATE conversations SET persona_id=? WHERE id=?", (persona_id, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,))

    # -- messages --

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self.db.execute("SELECT id, position, role, content, token_ids, stats, interrupted FROM messages "
                               "WHERE conversation_id=? ORDER BY position", (conversation_id,)).fetchall()
        return [Message(r[0], r[1], r[2], r[3], json.loads(r[4]) if r[4] else None,
                        json.loads(r[5]) if r[5] else None, bool(r[6])) for r in rows]

    def add_message(self, conversation_id: int, role: str, content: str, token_ids=None, stats=None,
                    interrupted: bool = False) -> int:
        with self.db:
            self.db.execute("BEGIN")
            position = self.db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE conversation_id=?",
                                       (conversation_id,)).fetchone()[0]
            message_id = self.db.execute(
                "INSERT INTO messages (conversation_id, position, role, content, token_ids, stats, interrupted, created)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, position, role, content, _ids(token_ids), _json(stats), int(interrupted),
                 time.time())).lastrowid
            self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (time.time(), conversation_id))
        return message_id

    def update_message(self, message_id: int, content: str, token_ids=None, stats=None,
                       interrupted: bool = False) -> None:
        """Used while a reply streams (interrupted until it finishes) and when it ends."""
        self.db.execute("UPDATE messages SET content=?, token_ids=?, stats=?, interrupted=? WHERE id=?",
                        (content, _ids(token_ids), _json(stats), int(interrupted), message_id))

    def truncate(self, conversation_id: int, from_position: int) -> None:
        """Drop messages from a position on: regenerate and edit-and-resend."""
        self.db.execute("DELETE FROM messages WHERE conversation_id=? AND position>=?", (conversation_id, from_position))

    # -- settings --

    def setting(self, key: str, default=None):
        row = self.db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_setting(self, key: str, value) -> None:
        self.db.execute("INSERT INTO settings VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                        (key, json.dumps(value)))

    # -- export --

    def export_json(self, conversation_id: int) -> str:
        conv = self.conversation(conversation_id)
        persona = next((p for p in self.personas() if p["id"] == conv["persona_id"]), None)
        return json.dumps({"title": conv["title"], "persona": persona,
                           "messages": [{"role": m.role, "content": m.content, "stats": m.stats,
                                         "interrupted": m.interrupted} for m in self.messages(conversation_id)]},
                          indent=2, ensure_ascii=False)

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.conversation(conversation_id)
        persona = next((p for p in self.personas() if p["id"] == conv["persona_id"]), None)
        lines = [f"# {conv['title']}", ""]
        if persona:
            lines += [f"*Persona: {persona['name']}*", "", f"> {persona['system_prompt']}", ""]
        for m in self.messages(conversation_id):
            lines += [f"## {m.role.capitalize()}" + (" (interrupted)" if m.interrupted else ""), "", m.content, ""]
        return "\n".join(lines)


@contextmanager
def _unique_name(name: str):
    """Persona names are required and unique: say so as a ValueError, not a database error."""
    if not name.strip():
        raise ValueError("a persona needs a name")
    try:
        yield
    except sqlite3.IntegrityError:
        raise ValueError(f"a persona named {name.strip()!r} already exists") from None


def _json(value):
    return None if value is None else json.dumps(value)


def _ids(token_ids):
    """Token ids are kept only when they are the model's own: a server's reply streams -1 for each
    delta, and the prompt encoder must never see one (it re-tokenizes the text instead)."""
    if not token_ids or any(i < 0 for i in token_ids):
        return None
    return json.dumps(token_ids)
