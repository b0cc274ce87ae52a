"""``sparkq fidelity``: an artifact against its bf16 reference, teacher-forced and greedy.

Teacher-forced over a text corpus in windows of ``window`` tokens (each from position 0):
top-1 agreement, KL(reference || artifact) per position (mean, p99), perplexity of each.
Greedy: exact reproductions over a prompt set and the mean position of first divergence.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from ..torchrt.api import load
from ..common import DEFAULT_KV_DTYPE
from ..errors import RuntimeUserError
from ..options import PREFILL_MODES

GREEDY_CAVEAT = ("greedy reproductions saturate: one early divergence changes everything after it, so counts "
                 "move in big steps and say little about small quality differences; prefer KL and top-1")


def default_prompts() -> list[str]:
    text = resources.files("sparkq.runtime").joinpath("prompts/fidelity.txt").read_text()
    return [l for l in text.splitlines() if l.strip()]


def teacher_forced(art, ref, ids: list[int], window: int) -> dict:
    kls, agree, nll_a, nll_r, n = [], 0, 0.0, 0.0, 0
    for s in range(0, len(ids) - 1, window):
        w = ids[s:s + window + 1]
        if len(w) < 2:
            break
        x, y = w[:-1], torch.tensor(w[1:])
        la = art.logits(x).log_softmax(-1)
        lr = ref.logits(x).log_softmax(-1)
        kls.append((lr.exp() * (lr - la)).sum(-1))
        agree += int((la.argmax(-1) == lr.argmax(-1)).sum())
        nll_a += float(-la.gather(1, y[:, None]).sum())
        nll_r += float(-lr.gather(1, y[:, None]).sum())
        n += len(x)
    kl = torch.cat(kls).double()
    return {"tokens": n, "top1_agreement": agree / n, "kl_mean": float(kl.mean()),
            "kl_p99": float(torch.quantile(kl, 0.99)), "ppl_artifact": float(torch.exp(torch.tensor(nll_a / n))),
            "ppl_reference": float(torch.exp(torch.tensor(nll_r / n)))}


def greedy(art, ref, prompts: list[str], new_tokens: int) -> dict:
    same, first_div = 0, []
    for p in prompts:
        ids = art.prompt_ids(p)
        a = list(art.stream_ids(ids, max_new_tokens=new_tokens, stop_ids=[]))
        r = list(ref.stream_ids(ids, max_new_tokens=new_tokens, stop_ids=[]))
        d = next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), new_tokens)
        same += d == new_tokens
        first_div.append(d)
    return {"prompts": len(prompts), "new_tokens": new_tokens, "identical": same,
            "mean_first_divergence": sum(first_div) / len(first_div), "first_divergence": first_div,
            "caveat": GREEDY_CAVEAT}


def fidelity(artifact: str, reference: str, corpus: str, tokens: int = 4096, window: int = 512,
             prompts: list[str] | None = None, new_tokens: int = 32, threads: int | None = None,
             prefill_dequant: bool | None = None, kv_dtype: str = DEFAULT_KV_DTYPE,
             reference_kv_dtype: str = "bf16") -> dict:
    p = Path(corpus)
    if not p.is_file():
        raise RuntimeUserError(f"corpus {corpus}: no such file; pass --corpus FILE (any UTF-8 text)")
    if tokens < 2 or window < 1:
        raise RuntimeUserError("--tokens must be >= 2 and --window >= 1")
    # a budget for the whole window (the cache's pages are touched only as positions are written)
    art = load(artifact, max_model_len=window + new_tokens + 64, kv_budget_mib=4096, threads=threads,
               prefill_dequant=prefill_dequant, kv_dtype=kv_dtype)
    ref = load(reference, max_model_len=window + new_tokens + 64, kv_budget_mib=4096, threads=threads,
               kv_dtype=reference_kv_dtype)
    if art.tokenizer is None:
        raise RuntimeUserError(f"{artifact}: no tokenizer.json, cannot tokenize the corpus")
    text = p.read_text(encoding="utf-8", errors="replace")
    ids = art.tokenizer.encode(text[: tokens * 12])[: tokens + 1]
    if len(ids) < tokens + 1:
        raise RuntimeUserError(f"corpus {corpus} gives only {len(ids)} tokens; lower --tokens or use a longer file")
    return {"artifact": artifact, "reference": reference, "corpus": str(p), "window": window,
            "kv_dtype": kv_dtype, "reference_kv_dtype": reference_kv_dtype,
            "prefill": next(k for k, v in PREFILL_MODES.items() if v is prefill_dequant),
            "teacher_forced": teacher_forced(art, ref, ids, window),
            "greedy": greedy(art, ref, prompts or default_prompts(), new_tokens)}
