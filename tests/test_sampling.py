"""The one sampler (runtime/sampling.py) that generate, chat and serve share: each control's
definition on hand-made logits, and its refusals."""
import numpy as np
import pytest

from sparkq.runtime.errors import RuntimeUserError
from sparkq.runtime.sampling import Sampler, SamplingParams, logprobs


def test_penalties_and_bias_follow_their_definitions():
    z = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    s = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1])
    assert np.allclose(s.adjusted(z), [1.0, -4.0, 1.0, 0.5])  # transformers': positive / p, negative * p
    s = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    s.accept(2), s.accept(2), s.accept(3)
    assert np.allclose(s.adjusted(z), [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25])  # OpenAI's
    s = Sampler(SamplingParams(logit_bias={1: 100.0}))
    assert s(z) == 1  # greedy on the biased logits
    mask = np.array([False, False, True, True])
    assert all(Sampler(SamplingParams(temperature=1.5, seed=i))(z, mask) in (2, 3) for i in range(20))


def test_top_k_min_p_and_temperature_shape_the_draw():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    draws = lambda **kw: {Sampler(SamplingParams(temperature=1.0, seed=i, **kw))(z) for i in range(200)}  # noqa: E731
    assert draws() == {0, 1, 2, 3}
    assert draws(top_k=2) == {0, 1}
    assert draws(min_p=0.5) == {0, 1}  # p >= 0.5 * 0.5
    assert draws(top_k=1) == {0} == {Sampler(SamplingParams())(z)}
    a = [Sampler(SamplingParams(temperature=0.9, top_p=0.9, seed=7))(z) for _ in range(5)]
    assert len(set(a)) == 1  # a seed, the same token


def test_logprobs_are_log_softmax():
    z = np.array([3.0, 1.0, -1.0], np.float32)
    lp = logprobs(z)
    assert np.allclose(np.exp(lp).sum(), 1.0) and np.allclose(lp, z - np.log(np.exp(z.astype(np.float64)).sum()))


@pytest.mark.parametrize("kw,needle", [(dict(top_k=-1), "top_k"), (dict(min_p=2.0), "min_p"),
                                      (dict(repetition_penalty=0.0), "repetition_penalty"),
                                      (dict(presence_penalty=3.0), "presence_penalty"), (dict(top_p=0.0), "top_p"),
                                      (dict(logit_bias={5: 1000.0}), "logit_bias")])
def test_bad_controls_are_one_line_errors(kw, needle):
    with pytest.raises(RuntimeUserError, match=needle):
        SamplingParams(**kw).check(vocab=10)
    with pytest.raises(RuntimeUserError, match="outside the vocabulary"):
        SamplingParams(logit_bias={10: 1.0}).check(vocab=10)


def test_top_tokens_is_the_stable_sort_without_sorting_the_vocabulary():
    """top_tokens (logprobs' alternatives) = argsort(-lp, stable)[:k], ties at the k-th value included"""
    from sparkq.runtime.sampling import top_tokens

    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 60))
        lp = np.round(rng.normal(size=n), 1)  # coarse: many ties
        for k in (0, 1, 2, int(rng.integers(0, n + 3))):
            assert top_tokens(lp, k).tolist() == np.argsort(-lp, kind="stable")[:k].tolist(), (lp, k)
