"""Is a persona's prefix warm? The question the app's badge asks: the answer comes from the pool's
prefix cache and its RAM and disk tiers, not from what a window remembers.

"warm": every full block of the persona's prefix is in the pool now (the next reply skips it);
"disk": not in the pool, but RAM or disk holds its KV for this model and precision (restored, not computed);
"cold": it would be computed; "short": the persona is shorter than one block, nothing to cache.
A model with windowed layers in rings reuses a prefix only where a kept ring holds its window
(``Rings.holding``): its persona is "warm" then, "disk" where the disk holds its persona ring
(``ring_prefix``) beside its blocks, else "cold", whatever the blocks and tiers hold.
"""


def persona_state(formatter, manager, tiers, system_prompt: str) -> str:
    """The blocks are named exactly as a request names them: the persona rendered as the system
    message ahead of a user message, chained hashes with the pool's extra key (model, precision)."""
    encoded = formatter.encode([{"role": "system", "content": system_prompt}, {"role": "user", "content": "."}])
    persona_len = encoded.message_starts[1]
    n = persona_len // manager.block_size
    if n == 0:
        return "short"
    chain = list(manager.chain(encoded.token_ids, n))
    pooled = all(manager.pool.lookup(h, chunk) is not None for chunk, h in chain)
    rings = manager.rings
    if rings is not None and not rings.holding(encoded.token_ids, n * manager.block_size):
        # its persona ring on disk, with its blocks (after a restart): restored, not computed
        return "disk" if tiers.holds_ring(chain[-1][1]) and (pooled or tiers.holds(chain[-1][1])) else "cold"
    if pooled:
        return "warm"
    if tiers.holds(chain[-1][1]):
        return "disk"
    return "cold"


def answer_persona_query(session, command) -> None:
    """A ``PersonaQuery``, on the engine thread: "cold" while no model is loaded (``session`` None)."""
    try:
        state = "cold" if session is None else persona_state(
            session.formatter, session.kvpool.manager, session.kvpool.tiers, command.system_prompt)
    except Exception as error:  # the future resolves whatever happens
        return command.future.set_exception(error)
    command.future.set_result(state)
