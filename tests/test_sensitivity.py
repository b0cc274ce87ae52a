"""convert/sensitivity.py: the budget's damage scale, KL per unit of relative output error, measured
by rounding one linear at a time in one growing batch; checked against plain forwards that round
that linear alone."""
import pytest
import torch

from helpers import make_llama
from sparkq.convert import sensitivity as S
from sparkq.convert.calib import Calibration
from sparkq.convert.pipeline import Options
from sparkq.convert.plan import plan
from sparkq.convert.source import read_fused_rows as _read_fused_rows
from sparkq.convert.source import open_source
from sparkq.formats import constants as C


@pytest.fixture(scope="module", params=["tied", "untied"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("sens")
    tied = request.param == "tied"
    path = make_llama(d / "src", tied=tied, hidden=128, inter=256, layers=3, vocab=512,
                      arch="llama" if tied else "qwen2")
    src = open_source(str(path))
    _, spec, linears, _, srcs = plan(src, Options(progress=False))
    weight = lambda lin, a, b: _read_fused_rows(src, lin.sources, spec.part_rows(lin.name, len(lin.sources)), a, b).float()  # noqa: E731
    yield src, spec, linears, srcs, weight
    src.close()


def test_rtn_error_is_the_int4_rounding_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 256, generator=g)
    e = S.rtn_error(w)
    assert torch.equal(S.rtn_error(w, rows=7), e)  # row blocks change nothing
    q = (w - e).view(40, 2, 128)
    lo, hi = w.view(40, 2, 128).amin(-1), w.view(40, 2, 128).amax(-1)
    step = (hi - lo) / 15
    assert torch.allclose(q.amin(-1), lo, atol=1e-6) and torch.allclose(q.amax(-1), hi, atol=1e-5)
    codes = (q - lo[..., None]) / step[..., None]
    assert torch.allclose(codes, codes.round(), atol=1e-3)  # 16 levels per group of 128
    assert bool((e.abs().view(40, 2, 128) <= step[..., None] / 2 + 1e-6).all())
    assert S.rtn_error(torch.randn(8, 96, generator=g)).shape == (8, 96)  # g32 where 128 and 64 do not divide K


def _logprobs(cal, spec, head_w):
    return (cal.final_states() @ head_w.T).log_softmax(-1)


def _direct(src, spec, linears, srcs, weight, ids, name):
    """KL of the model with only ``name`` rounded, over the relative output error that made: plain
    forwards, the rounded weight multiplied as is."""
    head = next(l for l in linears if l.name == C.ROLE_LM_HEAD)
    head_w = weight(head, 0, head.n)
    kls, rel = [], None
    for rounded in (False, True):
        cal = Calibration(src, spec, srcs, ids)
        if rounded and name == C.ROLE_EMBED:
            rows = weight(next(l for l in linears if l.name == (C.ROLE_EMBED if not spec.tied else C.ROLE_LM_HEAD)), 0,
                          spec.vocab)[ids.reshape(-1)]
            e = S.rtn_error(rows)
            rel = float(e.pow(2).sum() / rows.pow(2).sum())
            cal.x = rows - e
        for lin in linears:
            if lin.name in (C.ROLE_EMBED, C.ROLE_LM_HEAD):
                continue
            x = cal.inputs(lin.name).float()
            w = weight(lin, 0, lin.n)
            if rounded and lin.name == name:
                e = S.rtn_error(w)
                rel = float((x @ e.T).pow(2).sum() / (x @ w.T).pow(2).sum())
                w = w - e
            cal.advance(lin.name, w)
        hw = head_w
        if rounded and name == C.ROLE_LM_HEAD:
            x = cal.final_states()
            rel = float((x @ S.rtn_error(hw).T).pow(2).sum() / (x @ hw.T).pow(2).sum())
            hw = hw - S.rtn_error(hw)
        kls.append(_logprobs(cal, spec, hw))
    base, lp = kls
    return float((base.exp() * (base - lp)).sum(-1).mean()) / rel


def test_batched_measurement_equals_plain_forwards(model, monkeypatch):
    """Every sampled linear's sensitivity, the head's and the embedding's (added into the head's
    when tied) equal plain forwards that round that one weight; a layer between two sampled
    ones takes their interpolation."""
    src, spec, linears, srcs, weight = model
    monkeypatch.setattr(S, "LAYERS", 2)  # layers 0 and 2 of 3 sampled; 1 interpolated
    assert S.sampled_layers(spec.layers) == [0, 2]
    ids = torch.randint(0, spec.vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    steps = []
    sens = S.sensitivities(src, spec, srcs, linears, ids, weight, bar=type("B", (), {"update": steps.append})())
    assert len(steps) == 4 * spec.layers + 1
    names = {l.name for l in linears}
    assert set(sens) == names - ({C.ROLE_EMBED} if spec.tied else set())
    one = ids.reshape(-1)[:S.TOKENS].view(1, -1)
    for r in C.LAYER_LINEARS:
        for i in (0, 2):
            n = f"layers.{i}.{r}"
            assert sens[n] == pytest.approx(_direct(src, spec, linears, srcs, weight, one, n), rel=2e-3), n
        assert sens[f"layers.1.{r}"] == pytest.approx((sens[f"layers.0.{r}"] + sens[f"layers.2.{r}"]) / 2)
    head = _direct(src, spec, linears, srcs, weight, one, C.ROLE_LM_HEAD)
    embed = _direct(src, spec, linears, srcs, weight, one, C.ROLE_EMBED)
    if spec.tied:
        assert sens[C.ROLE_LM_HEAD] == pytest.approx(head + embed, rel=2e-3)
    else:
        assert sens[C.ROLE_LM_HEAD] == pytest.approx(head, rel=2e-3)
        assert sens[C.ROLE_EMBED] == pytest.approx(embed, rel=2e-3)
    assert all(v > 0 for v in sens.values())
