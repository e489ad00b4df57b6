"""Next-token choice from one row of logits: greedy, temperature, top-k/p, min-p, repetition penalty."""
import torch

from kvchat.core.config import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams, device="cpu"):
        self.params = params
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)
        self._seen, self._taken = None, 0  # the penalty's mask over the vocabulary, and how many ids it holds

    def __call__(self, logits: torch.Tensor, seen_ids: list[int] | torch.Tensor | None = None,
                 proposed: int | None = None) -> int:
        """``seen_ids``: the tokens the repetition penalty applies to. A list is the sequence's own
        token list, growing between calls: only its new ids are added to the mask, so a step does
        not copy the whole context to the device. ``proposed``: a token proposed for this place
        (speculation): sampled, it is kept with its probability, else a token is drawn from the
        others renormalised (Leviathan et al. and Chen et al., 2023, for a proposer sure of its
        token), so the token's distribution is the sampler's own; greedy, the argmax either way."""
        p = self.params
        logits = logits.float()
        if p.repetition_penalty != 1.0 and seen_ids is not None and len(seen_ids):
            logits = apply_repetition_penalty(logits, self._mask(seen_ids, logits), p.repetition_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        scaled = logits / p.temperature
        if not torch.isfinite(scaled.max()):
            # a temperature or penalty so close to 0 that a logit overflowed: the limit is greedy
            return int(torch.argmax(logits))
        probs = filtered_probs(scaled, p.top_k, p.top_p, p.min_p)
        if proposed is not None:
            if float(torch.rand((), generator=self.generator, device=probs.device)) < float(probs[proposed]):
                return proposed
            probs = probs.clone()
            probs[proposed] = 0.0
            probs = probs / probs.sum()  # > 0: the proposal's probability was under 1
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _mask(self, seen_ids, logits: torch.Tensor) -> torch.Tensor:
        if isinstance(seen_ids, torch.Tensor):
            return torch.zeros_like(logits, dtype=torch.bool).index_fill_(0, seen_ids.to(logits.device), True)
        if self._seen is None:
            self._seen = torch.zeros_like(logits, dtype=torch.bool)
        new = seen_ids[self._taken:]
        if len(new) == 1:
            self._seen[new[0]] = True  # a fill, no copy from the host
        elif new:
            self._seen[torch.tensor(new, device=logits.device)] = True
        self._taken = len(seen_ids)
        return self._seen


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style, as transformers does it: a seen token's logit (``seen``, a mask over the
    vocabulary) is divided by the penalty when positive and multiplied when negative."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # the top token always stays: a top_p so small that top_p * sum rounds to 0 (1e-300 in
        # float32) would otherwise mask every token and sample from NaNs
        sorted_probs = sorted_probs.masked_fill((before >= top_p * sorted_probs.sum()) & (before > 0), 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return probs / probs.sum()
