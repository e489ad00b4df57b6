"""A deleted chat's KV leaves every tier (its persona's stays); "Clear cached conversations" empties
RAM and disk and the pool's cached blocks, but for the personas' (pinned)."""
from kvchat.core.config import EngineConfig
from kvchat.core.kv_sizes import KVShape, bytes_per_token
from kvchat.engine.engine import Engine
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.kv.forget import chat_blocks
from kvchat.engine.model.loading import LoadedModel

PERSONA = {"role": "system", "content": "You are a careful librarian who answers in one sentence. " * 6}
GREEDY = dict(max_new_tokens=16, temperature=0)


def small_engine(lm, tmp_path) -> Engine:
    """8 blocks: a second chat pushes the first one's own blocks (not its pinned persona) to RAM."""
    per_token = bytes_per_token(KVShape.from_config(lm.model.config), "fp16", lm.dtype.itemsize)
    config = EngineConfig(max_context=1024, kv_budget_bytes=int(128 * per_token), ram_cache_bytes=1 << 30)
    e = Engine(config, loaded=LoadedModel(**vars(lm)), disk_tier=DiskTier(tmp_path))
    e.wait_ready()
    return e


def chat(e: Engine, question: str) -> list[dict]:
    messages = [PERSONA, {"role": "user", "content": question}]
    done = e.generate(messages, **GREEDY)
    return messages + [{"role": "assistant", "content": done.text, "token_ids": done.token_ids}]


def computed_blocks(e: Engine, messages: list[dict]) -> int:
    """Full blocks of prompt and reply, less the reply's last token (never computed)."""
    return (len(e.session.formatter.encode(messages[:2]).token_ids) + len(messages[2]["token_ids"]) - 1) // 16


def where(e: Engine, hashes) -> dict:
    tiers = e.kvpool.tiers
    return {"pool": sum(h in e.kvpool.blocks.cached for h in hashes), "ram": sum(h in tiers.host for h in hashes),
            "disk": sum(tiers.disk.has(h) for h in hashes)}


def test_deleting_a_chat_deletes_its_blocks_from_every_tier_and_keeps_the_persona(short_starter, tmp_path):
    e = small_engine(short_starter, tmp_path)
    try:
        doomed = chat(e, "Which book should I read first to learn about the history of Rome?")
        kept = chat(e, "How do I find a quiet place to study in a busy city?")
        mine, theirs = (chat_blocks(e.session.formatter, e.kvpool.manager, m)[1] for m in (doomed, kept))
        persona = e.session.formatter.encode([PERSONA, doomed[1]]).message_starts[1] // 16
        persona_hashes = [h for _, h in e.kvpool.manager.chain(e.session.formatter.encode(doomed).token_ids, persona)]
        before = where(e, mine)
        # in RAM after the other chat; on disk, every full block the chat computed
        assert before["ram"] > 0 and before["disk"] == computed_blocks(e, doomed) - persona >= 2
        assert e.forget(doomed).result(10) >= len(mine)
        assert where(e, mine) == {"pool": 0, "ram": 0, "disk": 0}
        assert where(e, theirs)["disk"] == computed_blocks(e, kept) - persona >= 2
        assert where(e, persona_hashes)["pool"] == persona
        again = e.generate(doomed[:2], **GREEDY)  # the first question again: only the persona is cached
    finally:
        e.close()
    # what it shares with the chat that stays, the persona and the template's "user" header, and nothing more
    shared = next(i for i, (a, b) in enumerate(zip(e.session.formatter.encode(doomed[:2]).token_ids,
                                                   e.session.formatter.encode(kept).token_ids)) if a != b)
    assert again.stats.cached_tokens == shared > persona * 16
    assert again.stats.ram_tokens == again.stats.disk_tokens == 0


def test_clear_cached_conversations_empties_ram_and_disk_and_keeps_pinned_personas(short_starter, tmp_path):
    e = small_engine(short_starter, tmp_path)
    try:
        first = chat(e, "Which book should I read first to learn about the history of Rome?")
        chat(e, "How do I find a quiet place to study in a busy city?")
        assert len(e.kvpool.tiers.host) > 0 and list(tmp_path.glob("*.kvb"))
        assert e.forget(None).result(10) > 0
        assert len(e.kvpool.tiers.host) == 0 and e.kvpool.tiers.host.used == 0
        pinned = list(tmp_path.glob("*.pin"))  # the persona's blocks: shared by its chats, kept
        assert list(tmp_path.glob("*.kvb")) == [] and e.kvpool.tiers.disk.used == sum(p.stat().st_size for p in pinned)
        assert all(b.pinned for b in e.kvpool.blocks.cached.values())
        again = e.generate(first[:2], **GREEDY)
    finally:
        e.close()
    persona = e.session.formatter.encode(first[:2]).message_starts[1] // 16
    assert again.stats.cached_tokens == persona * 16 and len(pinned) == persona
