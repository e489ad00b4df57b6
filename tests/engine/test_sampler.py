import pytest
import torch

from kvchat.core.config import ConfigError, SamplingParams
from kvchat.engine.sampler import Sampler, apply_repetition_penalty, filtered_probs

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0))(torch.tensor([0.1, 3.0, -1.0])) == 1


def test_top_k_keeps_k():
    probs = filtered_probs(LOGITS, top_k=2, top_p=1.0, min_p=0.0)
    assert torch.allclose(probs, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = filtered_probs(LOGITS, top_k=0, top_p=0.8, min_p=0.0)  # 0.5 + 0.25 < 0.8 <= 0.9
    assert torch.allclose(probs, torch.tensor([0.5, 0.25, 0.15, 0, 0]) / 0.9)


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = filtered_probs(LOGITS, top_k=0, top_p=1.0, min_p=0.2)  # threshold 0.1
    assert torch.allclose(probs, torch.tensor([0.5, 0.25, 0.15, 0, 0]) / 0.9)


def test_repetition_penalty_as_transformers_defines_it():
    out = apply_repetition_penalty(torch.tensor([2.0, -2.0, 1.0]), torch.tensor([True, True, False]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_a_growing_token_list_penalises_every_id_in_it_as_a_tensor_of_them_does():
    """The engine hands the sequence's own list, one id longer each step; the sampler adds only the
    new ids to its mask. Each step must choose as a fresh sampler given all ids would."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, repetition_penalty=1.3)
    growing, context = Sampler(params), [5, 9, 5, 2]
    for step in range(40):
        logits = torch.randn(16, generator=g) + 3 * torch.nn.functional.one_hot(torch.tensor(context[-1]), 16)
        want = Sampler(params)(logits, torch.tensor(context))
        assert growing(logits, context) == want, step
        context.append(int(torch.randint(0, 16, (1,), generator=g)))


def test_seed_makes_sampling_repeatable_and_follows_the_distribution():
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [Sampler(params)(LOGITS) for _ in range(3)]
    assert len(set(draws)) == 1
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = torch.bincount(torch.tensor([s(LOGITS) for _ in range(4000)]), minlength=5) / 4000
    assert torch.allclose(counts, LOGITS.exp(), atol=0.03)


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(temperature=-1),
                                 dict(top_p=0), dict(top_p=1.5), dict(min_p=1), dict(top_k=-1),
                                 dict(repetition_penalty=0)])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)
