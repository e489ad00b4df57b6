"""Privacy: a deleted chat's KV, or every cached conversation's, deleted from the pool, RAM and disk.

A chat's blocks are named as its requests named them: the conversation rendered message by message
(its replies as the token ids they were generated as), chained block hashes with the pool's extra
key. The persona's blocks stay: other chats with the same persona share them."""
import logging

from kvchat.core.commands import Forget
from kvchat.core.errors import first_line
from kvchat.core.events import EngineError

log = logging.getLogger("kvchat.engine")


def answer_forget(engine, command: Forget) -> None:
    """On the engine thread, between two steps; the future resolves whatever happens."""
    try:
        if command.messages is None:
            n = clear_conversations(engine)
        else:
            n = forget_chat(engine, command.messages) if engine.kvpool is not None else 0
    except Exception as error:
        log.exception("forgetting cached KV failed")
        return command.future.set_exception(EngineError(f"could not delete cached KV: {first_line(error)}"))
    command.future.set_result(n)


def chat_hashes(formatter, manager, messages: list[dict]) -> list[bytes]:
    """The chained hashes of a conversation's full blocks after its persona's."""
    encoded = formatter.encode(messages, add_generation_prompt=messages[-1]["role"] == "user")
    persona = formatter.persona_length(messages, encoded)
    ids = encoded.token_ids
    return [h for _, h in manager.chain(ids, len(ids) // manager.block_size)][persona // manager.block_size:]


def chat_in_use(engine, messages: list[dict]) -> bool:
    """A running reply holds some of the chat's blocks: dropped now, they would be skipped (a held
    block is not dropped) and cached again when the reply ends. The app deletes no streaming chat;
    this keeps another caller's Forget exact."""
    if engine.kvpool is None:
        return False
    try:
        doomed = set(chat_hashes(engine.formatter, engine.kvpool.manager, messages))
    except Exception:  # answer_forget runs it again and says what is wrong with the messages
        return False
    return any(b.hash in doomed or b.parent in doomed for seq in engine.scheduler.live() for b in seq.blocks)


def forget_chat(engine, messages: list[dict]) -> int:
    kvpool = engine.kvpool
    doomed = set(chat_hashes(engine.formatter, kvpool.manager, messages))
    pool = kvpool.pool
    # full blocks by hash, and the partly filled tails that follow them (free(keep_tail=True))
    blocks = [b for b in pool.cached.values() if b.hash in doomed or b.parent in doomed]
    if kvpool.rings is not None:  # the kept rings: this chat's windowed rows may be among them
        kvpool.rings.forget()
    return pool.drop(blocks) + kvpool.tiers.forget(doomed)


def clear_conversations(engine) -> int:
    """Every cached conversation: the pool's free cached blocks (pinned personas stay), RAM, disk."""
    kvpool = engine.kvpool
    if kvpool is None:
        disk = engine.host.disk_tier(engine.config)
        return disk.clear() if disk is not None else 0
    pool = kvpool.pool
    if kvpool.rings is not None:
        kvpool.rings.forget()
    return pool.drop([b for b in list(pool.free_queue.values()) if b.hash is not None]) + kvpool.tiers.clear()
