"""Sampling defaults for a model: what its generation_config.json sets, else values that keep a small
model from rambling (the GUI's replies may run to 1,024 tokens)."""
FALLBACK = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.1,
            "max_new_tokens": 1024, "seed": None}
FROM_MODEL = ("temperature", "top_p", "top_k", "repetition_penalty")


def model_defaults(generation: dict | None) -> dict:
    """``generation``: what the model's authors set (ModelReady.generation), nothing of transformers'
    own defaults. A model that asks for greedy decoding gets it."""
    out = dict(FALLBACK)
    chosen = generation or {}
    for key in FROM_MODEL:
        value = chosen.get(key)
        if value is not None:
            out[key] = type(FALLBACK[key])(value)
    if chosen.get("do_sample") is False:
        out["temperature"] = 0.0
    return out
