"""Privacy: a deleted chat's KV, or every cached conversation's, deleted from the pool, RAM and disk.

A chat's blocks are named as its requests named them: the conversation rendered message by message
(its replies as the token ids they were generated as), chained block hashes with the pool's extra
key. The persona's blocks stay: other chats with the same persona share them."""
import logging

from kvchat.core.commands import Forget
from kvchat.core.errors import first_line
from kvchat.core.events import EngineError

log = logging.getLogger("kvchat.engine")


def answer_forget(session, command: Forget, disk_tier) -> None:
    """On the engine thread, between two steps; the future resolves whatever happens. With no
    model loaded (``session`` None) Forget(None) still clears ``disk_tier()``."""
    try:
        if command.messages is None:
            n = clear_conversations(session, disk_tier)
        else:
            n = forget_chat(session, command) if session is not None else 0
    except Exception as error:
        log.exception("forgetting cached KV failed")
        return command.future.set_exception(EngineError(f"could not delete cached KV: {first_line(error)}"))
    command.future.set_result(n)


def chat_blocks(formatter, manager, messages: list[dict]) -> tuple[int, list[bytes]]:
    """Where a conversation's own full blocks start (after its persona's), and their chained hashes."""
    encoded = formatter.encode(messages, add_generation_prompt=messages[-1]["role"] == "user")
    first, ids = formatter.persona_length(messages, encoded) // manager.block_size, encoded.token_ids
    return first, [h for _, h in manager.chain(ids, len(ids) // manager.block_size)][first:]


def named(session, command: Forget) -> tuple[int, list[bytes]]:
    """``chat_blocks`` of the Forget's chat, once per pool key: a held Forget is asked each step,
    and a precision change (the governor's, under memory pressure) renames every block."""
    manager = session.kvpool.manager
    if command.named is None or command.named[0] != manager.extra_key:
        command.named = (manager.extra_key, *chat_blocks(session.formatter, manager, command.messages))
    return command.named[1:]


def chat_in_use(session, jobs, command: Forget) -> bool:
    """A request of the scheduler's continues the chat: what it holds would be skipped (a held
    block is not dropped), and what it computes cached again as it ends. A request whose prompt is
    not made yet might, and counts. The app deletes no chat that has a reply under way; this keeps
    another caller's Forget exact."""
    if session is None:
        return False
    try:
        first, hashes = named(session, command)
    except Exception:  # answer_forget runs it again and says what is wrong with the messages
        return False
    if not hashes:
        return False
    manager = session.kvpool.manager
    for job in jobs:
        if job.seq is None:
            return True
        # hashes chain: a request that shares any of the chat's blocks shares its first one, so
        # that block alone is hashed (asked at every step the Forget waits)
        tokens = job.seq.token_ids
        if len(tokens) // manager.block_size > first and list(manager.chain(tokens, first + 1))[-1][1] == hashes[0]:
            return True
    return False


def forget_chat(session, command: Forget) -> int:
    kvpool = session.kvpool
    hashes = set(named(session, command)[1])
    pool = kvpool.blocks
    # full blocks by hash, and the partly filled tails that follow them (free(keep_tail=True))
    blocks = [b for b in pool.cached.values() if b.hash in hashes or b.parent in hashes]
    if kvpool.rings is not None:  # the kept rings: this chat's windowed rows may be among them
        kvpool.rings.forget()
    return pool.drop(blocks) + kvpool.tiers.forget(hashes)


def clear_conversations(session, disk_tier) -> int:
    """Every cached conversation: the pool's free cached blocks (pinned personas stay), RAM, disk."""
    if session is None:
        disk = disk_tier()
        return disk.clear() if disk is not None else 0
    kvpool = session.kvpool
    pool = kvpool.blocks
    if kvpool.rings is not None:
        kvpool.rings.forget()
    return pool.drop([b for b in list(pool.free_queue.values()) if b.hash is not None]) + kvpool.tiers.clear()
