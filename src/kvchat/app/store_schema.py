"""The chat database's tables, and the step that brings a database written by an older kvchat up to
them in place (one transaction: it either all happens or the file is as it was)."""
import hashlib
import sqlite3

SCHEMA_VERSION = 2
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
    created REAL NOT NULL, author TEXT, author_hash TEXT, version INTEGER NOT NULL DEFAULT 0,
    UNIQUE (conversation_id, position));
CREATE TABLE IF NOT EXISTS reply_versions (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE, idx INTEGER NOT NULL,
    content TEXT NOT NULL, token_ids TEXT, stats TEXT, interrupted INTEGER NOT NULL DEFAULT 0,
    author TEXT, author_hash TEXT, PRIMARY KEY (message_id, idx));
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# a reply's own columns: the ones a version keeps and the message row shows
VERSION_COLUMNS = ("content", "token_ids", "stats", "interrupted", "author", "author_hash")
ADDED_TO_MESSAGES = {"author": "TEXT", "author_hash": "TEXT", "version": "INTEGER NOT NULL DEFAULT 0"}
DEFAULT_AUTHOR = "Assistant"


def prompt_hash(system_prompt: str | None) -> str | None:
    """Names the system prompt a reply was written under: a persona renamed or rewritten later
    does not pass for the one of its time."""
    if system_prompt is None:
        return None
    return hashlib.sha256(system_prompt.encode()).hexdigest()[:16]


def migrate(db: sqlite3.Connection) -> None:
    """Version 1 had no author on a reply: each old reply gets its chat's persona as it is now (the
    best guess left; what the window showed for it until now), or "Assistant"."""
    have = {r[1] for r in db.execute("PRAGMA table_info(messages)")}
    missing = [c for c in ADDED_TO_MESSAGES if c not in have]
    if not missing:
        return
    with db:
        db.execute("BEGIN")
        for column in missing:
            db.execute(f"ALTER TABLE messages ADD COLUMN {column} {ADDED_TO_MESSAGES[column]}")
        rows = db.execute("SELECT m.id, p.name, p.system_prompt FROM messages m JOIN conversations c "
                          "ON c.id = m.conversation_id LEFT JOIN personas p ON p.id = c.persona_id "
                          "WHERE m.role = 'assistant' AND m.author IS NULL").fetchall()
        db.executemany("UPDATE messages SET author=?, author_hash=? WHERE id=?",
                       [(name or DEFAULT_AUTHOR, prompt_hash(prompt), mid) for mid, name, prompt in rows])
        db.execute("INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                   (str(SCHEMA_VERSION),))
