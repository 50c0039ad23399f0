import pytest
import torch
from spyre_runtime.sampling import SamplingParams, make_generator, sample, sample_batch


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0)] * 2
    assert sample_batch(logits, params, [None, None]) == [1, 0]


def test_same_seed_same_tokens_and_different_seed_differs():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, p, g) for g in [make_generator(7)] for _ in range(20)]
    b = [sample(logits, p, g) for g in [make_generator(7)] for _ in range(20)]
    c = [sample(logits, p, g) for g in [make_generator(8)] for _ in range(20)]
    assert a == b and a != c


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([4.0, 3.0, 2.0, -10.0, -10.0])
    g = make_generator(0)
    assert {sample(logits, SamplingParams(top_k=2), g) for _ in range(200)} <= {0, 1}
    # probabilities ~ .66 .24 .09: top_p 0.5 keeps only the first
    assert {sample(logits, SamplingParams(top_p=0.5), g) for _ in range(100)} == {0}
    assert {sample(logits, SamplingParams(top_p=0.95), g) for _ in range(400)} == {0, 1, 2}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_bad_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
