"""Sampling defaults for a model: what its generation_config.json sets, else values that keep a small
model from rambling (the GUI's replies may run to 1,024 tokens)."""
FALLBACK = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.1,
            "max_new_tokens": 1024, "seed": None}
FROM_MODEL = ("temperature", "top_p", "top_k", "repetition_penalty")


def model_defaults(generation_config) -> dict:
    """Only the values the model's authors set count (``to_diff_dict``: transformers' own defaults,
    e.g. top_k 50, say nothing about this model). A model that asks for greedy decoding gets it."""
    out = dict(FALLBACK)
    chosen = generation_config.to_diff_dict() if generation_config is not None else {}
    for key in FROM_MODEL:
        value = chosen.get(key)
        if value is not None:
            out[key] = type(FALLBACK[key])(value)
    if chosen.get("do_sample") is False:
        out["temperature"] = 0.0
    return out
