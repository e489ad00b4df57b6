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
from kvchat.app.store_schema import (DEFAULT_AUTHOR, SCHEMA, SCHEMA_VERSION, VERSION_COLUMNS, migrate,
                                     prompt_hash)

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
    author: str | None = None  # a reply's persona when it was written
    author_hash: str | None = None  # that persona's system prompt, hashed (store_schema.prompt_hash)
    version: int = 0  # which of the reply's versions the row shows
    versions: int = 1  # how many it has (regenerate keeps the earlier ones)

    def for_engine(self) -> dict:
        out = {"role": self.role, "content": self.content}
        if self.role == "assistant" and self.token_ids and not self.interrupted:
            out["token_ids"] = self.token_ids
        return out


def engine_messages(messages: list[Message], persona: dict | None, leave_out: int | None = None) -> list[dict]:
    """A chat as the engine gets it, under its ``persona``; ``leave_out``: the reply being
    written again."""
    head = [{"role": "system", "content": persona["system_prompt"]}] if persona else []
    return head + [m.for_engine() for m in messages if m.id != leave_out]


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            fresh = self._check_version()
            self.db.executescript(SCHEMA)
            migrate(self.db)
        except sqlite3.DatabaseError as e:
            backup = self._backup("broken")
            raise StoreError(f"the chat database {self.path} is damaged ({e}); a copy was kept at {backup}") from None
        self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        if fresh:  # only then: personas the user deleted, all of them included, stay deleted
            self._seed_personas()

    def _check_version(self) -> bool:
        """True for a new, empty database."""
        if not self.db.execute("SELECT name FROM sqlite_master WHERE name='meta'").fetchone():
            return True
        row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row and int(row[0]) > SCHEMA_VERSION:
            self.db.close()
            backup = self._backup("newer")
            raise StoreError(f"the chat database {self.path} was written by a newer kvchat (schema {row[0]}); "
                             f"update kvchat. A copy was kept at {backup}")
        return False

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
        rows = self.db.execute(
            "SELECT id, position, role, content, token_ids, stats, interrupted, author, author_hash, version, "
            "(SELECT COUNT(*) FROM reply_versions v WHERE v.message_id = messages.id) FROM messages "
            "WHERE conversation_id=? ORDER BY position", (conversation_id,)).fetchall()
        return [Message(r[0], r[1], r[2], r[3], json.loads(r[4]) if r[4] else None,
                        json.loads(r[5]) if r[5] else None, bool(r[6]), r[7], r[8], r[9], max(1, r[10]))
                for r in rows]

    def add_message(self, conversation_id: int, role: str, content: str, token_ids=None, stats=None,
                    interrupted: bool = False, persona: dict | None = None) -> int:
        """``persona``: the one writing a reply (None: no persona, "Assistant")."""
        author = (persona["name"] if persona else DEFAULT_AUTHOR) if role == "assistant" else None
        author_hash = prompt_hash(persona["system_prompt"]) if persona and role == "assistant" else None
        with self.db:
            self.db.execute("BEGIN")
            position = self.db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE conversation_id=?",
                                       (conversation_id,)).fetchone()[0]
            message_id = self.db.execute(
                "INSERT INTO messages (conversation_id, position, role, content, token_ids, stats, interrupted, created,"
                " author, author_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, position, role, content, _ids(token_ids), _json(stats), int(interrupted),
                 time.time(), author, author_hash)).lastrowid
            self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (time.time(), conversation_id))
        return message_id

    def update_message(self, message_id: int, content: str, token_ids=None, stats=None,
                       interrupted: bool = False) -> None:
        """Used while a reply streams (interrupted until it finishes) and when it ends; a reply with
        versions keeps the one it shows up to date too."""
        values = (content, _ids(token_ids), _json(stats), int(interrupted))
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("UPDATE messages SET content=?, token_ids=?, stats=?, interrupted=? WHERE id=?",
                            (*values, message_id))
            self.db.execute("UPDATE reply_versions SET content=?, token_ids=?, stats=?, interrupted=? WHERE "
                            "message_id=? AND idx=(SELECT version FROM messages WHERE id=?)",
                            (*values, message_id, message_id))

    def delete_message(self, message_id: int) -> None:
        """A reply that never got a word (stopped or quit before its first token) is not kept."""
        self.db.execute("DELETE FROM messages WHERE id=?", (message_id,))

    # -- a reply's versions (regenerate keeps the earlier ones) --

    def new_version(self, message_id: int, persona: dict | None) -> int:
        """Start another version of a reply: the row becomes it (empty, interrupted until it ends),
        the ones before stay in reply_versions. Returns its index."""
        cols = ", ".join(VERSION_COLUMNS)
        with self.db:
            self.db.execute("BEGIN")
            if not self.db.execute("SELECT 1 FROM reply_versions WHERE message_id=?", (message_id,)).fetchone():
                self.db.execute(f"INSERT INTO reply_versions (message_id, idx, {cols}) SELECT id, 0, {cols} "
                                "FROM messages WHERE id=?", (message_id,))
            idx = self.db.execute("SELECT MAX(idx) + 1 FROM reply_versions WHERE message_id=?",
                                  (message_id,)).fetchone()[0]
            values = ("", None, None, 1, persona["name"] if persona else DEFAULT_AUTHOR,
                      prompt_hash(persona["system_prompt"]) if persona else None)
            self.db.execute(f"INSERT INTO reply_versions (message_id, idx, {cols}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (message_id, idx, *values))
            self._show(message_id, idx)
        return idx

    def show_version(self, message_id: int, idx: int) -> None:
        """The row shows version ``idx``: what the reader sees and what the next turn sends."""
        with self.db:
            self.db.execute("BEGIN")
            self._show(message_id, idx)

    def drop_version(self, message_id: int) -> None:
        """Forget the version the row shows (a regenerate stopped before its first word); the one
        before it shows again."""
        with self.db:
            self.db.execute("BEGIN")
            shown = self.db.execute("SELECT version FROM messages WHERE id=?", (message_id,)).fetchone()[0]
            self.db.execute("DELETE FROM reply_versions WHERE message_id=? AND idx=?", (message_id, shown))
            left = self.db.execute("SELECT MAX(idx) FROM reply_versions WHERE message_id=?", (message_id,)).fetchone()[0]
            if left is not None:
                self._show(message_id, left)

    def _show(self, message_id: int, idx: int) -> None:
        sets = ", ".join(f"{c}=(SELECT {c} FROM reply_versions WHERE message_id=? AND idx=?)" for c in VERSION_COLUMNS)
        args = [a for _ in VERSION_COLUMNS for a in (message_id, idx)]
        if not self.db.execute("SELECT 1 FROM reply_versions WHERE message_id=? AND idx=?", (message_id, idx)).fetchone():
            raise KeyError(f"reply {message_id} has no version {idx}")
        self.db.execute(f"UPDATE messages SET {sets}, version=? WHERE id=?", (*args, idx, message_id))

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
                           "messages": [{"role": m.role, "author": m.author, "content": m.content, "stats": m.stats,
                                         "interrupted": m.interrupted} for m in self.messages(conversation_id)]},
                          indent=2, ensure_ascii=False)

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.conversation(conversation_id)
        persona = next((p for p in self.personas() if p["id"] == conv["persona_id"]), None)
        lines = [f"# {conv['title']}", ""]
        if persona:
            lines += [f"*Persona: {persona['name']}*", "", f"> {persona['system_prompt']}", ""]
        for m in self.messages(conversation_id):
            who = (m.author or DEFAULT_AUTHOR) if m.role == "assistant" else m.role.capitalize()
            lines += [f"## {who}" + (" (interrupted)" if m.interrupted else ""), "", m.content, ""]
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
