"""The torch-free runtime (runtime/lite/model.py) against the torch runtime on the same artifact."""
import json
import sys

import numpy as np
import pytest
import torch

from helpers import kernel_builds, make_llama, run_cli, run_py
from sparkq.convert.pipeline import Options, convert

K_ = pytest.importorskip("sparkq.runtime.core")
if K_.compiler() is None:
    pytest.skip("no C compiler: the torch-free runtime needs the C core", allow_module_level=True)


def test_lite_never_imports_torch_and_generates(tiny_tied_art):
    p = run_py(f"""
import json, sys
from sparkq.runtime import load_lite
m = load_lite({str(tiny_tied_art)!r}, max_model_len=64)
ids = list(m.stream_ids([5, 70, 200, 9], max_new_tokens=6, stop_ids=[]))
text = m.generate("hello", max_new_tokens=3)
print(json.dumps({{"torch": "torch" in sys.modules, "ids": ids, "path": m.info.extra["decode_path"],
                  "text": isinstance(text["text"], str)}}))
""")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["torch"] is False and len(r["ids"]) == 6 and r["text"] and "no torch" in r["path"], r


def _rel(a, b):
    a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lite_matches_the_torch_runtime(arch, kernel_build, tmp_path):
    """The same artifact through both runtimes (gemma3: sliding window, q/k norms, sandwich norms,
    embedding scale, GELU, softcap, two RoPE tables; llama: the tied int8 head): the same C calls
    on the same tables, so prompt logits, teacher-forced decode steps and greedy tokens are the
    same bits (with a final softcap, numpy's tanh against torch's: within 1e-6)."""
    from sparkq.runtime import load, load_lite

    extra = dict(arch="gemma3", layers=3, sliding_window=8, head_dim=32, final_logit_softcapping=30.0) \
        if arch == "gemma3" else {}
    src = make_llama(tmp_path / arch, **extra)
    out = tmp_path / f"{arch}-int4"
    convert(str(src), str(out), Options(progress=False, method="minmax"))
    tq, lm = load(str(out), max_model_len=64), load_lite(str(out), max_model_len=64)
    tm = tq.model
    assert tm.fast is not None and tm.prefill_off is None and tm.fast.lib is lm.lib
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3))
    pairs = [(lm.prefill(ids.numpy()).copy(), tm.forward(ids, 0, last_only=True)[0])]
    for i, t in enumerate(torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(4)).tolist()):
        pairs.append((lm.step(t, 20 + i).copy(), tm.forward(torch.tensor([t]), 20 + i)[0]))
    for a, b in pairs:
        if arch == "gemma3":
            assert _rel(a, b) < 1e-6, _rel(a, b)
        else:
            assert np.array_equal(a, b.numpy())
    prompt = ids.tolist()
    assert list(lm.stream_ids(prompt, max_new_tokens=12, stop_ids=[])) == \
        list(tq.stream_ids(prompt, max_new_tokens=12, stop_ids=[]))
    # one RoPE implementation for both runtimes: identical tables
    for rope in tm.ropes:
        cos, sin = lm.ropes[rope.key]
        assert np.array_equal(cos, rope.cos.view(torch.int16).numpy().view(np.uint16))
        assert np.array_equal(sin, rope.sin.view(torch.int16).numpy().view(np.uint16))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise/smaps are Linux")
def test_both_runtimes_advise_huge_pages_on_the_weights_mapping(tiny_tied_art):
    """The weights mapping carries MADV_HUGEPAGE (smaps VmFlags "hg"), so a file read in through
    it lands in 2 MiB folios; SPARKQ_THP=0 leaves it out."""
    code = """
import os
from sparkq.formats import constants as C
from sparkq.runtime.{mod} import load
m = load({art!r})
wpath = os.path.realpath(os.path.join({art!r}, C.WEIGHTS_FILE))
flags, cur = [], False
for line in open('/proc/self/smaps'):
    parts = line.split()
    if '-' in parts[0] and len(parts[0].split('-')) == 2 and all(c in '0123456789abcdef-' for c in parts[0]):
        cur = len(parts) >= 6 and parts[5] == wpath
    elif cur and line.startswith('VmFlags:'):
        flags.append('hg' in parts[1:])
print(flags)
"""
    for mod in ("lite", "torchrt"):
        for env, want in (({}, True), ({"SPARKQ_THP": "0"}, False)):
            p = run_py(code.format(mod=mod, art=str(tiny_tied_art)), env=env)
            assert p.returncode == 0, p.stderr[-2000:]
            flags = eval(p.stdout.strip().splitlines()[-1])
            assert flags and all(f == want for f in flags), (mod, env, flags)


def test_lite_errors_and_cli(tiny_tied_art, tmp_path):
    from sparkq.runtime import RuntimeUserError, load_lite

    m = load_lite(str(tiny_tied_art), max_model_len=16)
    with pytest.raises(RuntimeUserError, match="exceed the max_model_len capacity of 16"):
        list(m.stream_ids(list(range(10)), max_new_tokens=8))
    with pytest.raises(RuntimeUserError, match="empty prompt"):
        list(m.stream_ids([], max_new_tokens=2))
    from sparkq.runtime import load
    t = load(str(tiny_tied_art), max_model_len=16)
    for gen in (m, t):  # the C core reads embedding rows unchecked: both runtimes refuse bad ids first
        with pytest.raises(RuntimeUserError, match="token id 320 is outside the vocabulary"):
            list(gen.stream_ids([5, 320], max_new_tokens=2))
        with pytest.raises(RuntimeUserError, match="token id -1 is outside"):
            list(gen.stream_ids([-1], max_new_tokens=2))
    p = run_cli("sparkq", "generate", tiny_tied_art, "hello", "--lite", "--max-new-tokens", "3", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert len(r["token_ids"]) <= 3 and r["stats"]["threads"] >= 1
    for k in ("off", "avx9"):  # the C core turned off or a build name mistyped: one line, exit 2
        bad = run_cli("sparkq", "generate", tiny_tied_art, "hi", "--lite", env={"SPARKQ_KERNEL": k})
        assert bad.returncode == 2 and "unset SPARKQ_KERNEL" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    bad = run_cli("sparkq", "generate", tiny_tied_art, "hi", "--lite", "--prefill", "dequant")
    assert bad.returncode == 2 and "--prefill" in bad.stderr
    src = make_llama(tmp_path / "n")
    native = tmp_path / "native"
    convert(str(src), str(native), Options(progress=False, method="minmax", target="native"))
    bad = run_cli("sparkq", "generate", native, "hi", "--lite")
    assert bad.returncode == 2 and "rows32" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
