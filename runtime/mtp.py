"""Multi-token prediction heads as a drafter (``--draft mtp``): the block a checkpoint ships for it
(Qwen3.5's ``mtp.*``, formats/constants.py) drafts a sequence's next tokens from the model's own
hidden states, with no second model.

The block (vLLM's Qwen3_5MultiTokenPredictor): at position p its input is fc over [norm_e(embed(token
p + 1)) | norm_h(h_p)], h_p the model's final-normed hidden state at p; then its attention layer(s)
over its own KV cache, its norm and the model's head: the logits of token p + 2. Chained, a draft's
next input is the block's own output hidden state and the token it drafted. It runs in the C core
as a model of its own (core.Session over the block's layers, fc set, sharing the head and the
embedding in the mapping): one KV slot per target sequence, bf16.

The model's hidden states come from a tap on its Session (every prompt row and every checked row);
the block takes the pairs (h_p, token p + 1) it has not seen in the next proposal: the prompt's
through the prompt path, the last as the first row of its batched draft step. Rows of a rejected
draft leave nothing: their positions are fed again, with the model's states, before they are read.
A sequence whose hidden states the tap never saw (a prefix-cache hit, a step outside the C core)
gets no drafts: the output is the same, only slower.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
from sparkq.formats import constants as C
from sparkq.formats.artifact import Artifact, ArtifactError
from sparkq.formats.rope import rope_tables_bf16

from . import core
from .chat import common_prefix
from .common import decode_read_bytes
from .errors import RuntimeUserError
from .speculate import GIVE_UP, _below

CATCH_UP_ROWS = 8  # pending pairs fed as batched step rows up to this many, else through the prompt path
HOLD_PAIRS = 256  # pending pairs kept while a sequence does not draft (fed at its next draft: one prompt call)


class MtpBlock:
    """The artifact's MTP block over the C core: ``session`` (core.Session, fc set), ``slots`` KV slots
    of ``cap`` positions."""

    def __init__(self, path, *, slots: int, cap: int, threads: int, lib=None, tensors: dict | None = None):
        try:
            art = Artifact.open(Path(path))
        except ArtifactError as e:
            raise RuntimeUserError(str(e)) from None
        spec = art.spec
        if not spec.mtp_layers:
            raise RuntimeUserError(f"{path}: this artifact has no multi-token-prediction block (mtp.* tensors); convert a "
                                   "checkpoint that ships one (Qwen3.5) without --no-mtp, or use --draft ngram")
        n = spec.mtp_layers
        # the block's layers as a model of n attention layers (each a full-attention layer of the model)
        self.spec = mspec = replace(spec, layers=n, layer_types=("full_attention",) * n, gdn=None, mtp_layers=0,
                                    nope_layers=())
        t = self.tensors = tensors if tensors is not None else art.map_numpy()  # (the model's own mapping, where given)
        lin = {}
        for name, e in art.linears.items():
            if name.startswith(C.MTP_LAYER.format(j="")[:-1]):
                lin["layers." + name[len("mtp.layers."):]] = _clinear(name, e, t)
            elif name in (C.ROLE_LM_HEAD, C.ROLE_EMBED):
                lin[name] = _clinear(name, e, t)
        vec = {"layers." + k[len("mtp.layers."):]: t[k] for k in t if k.startswith("mtp.layers.") and k.endswith(".weight")
               and k.rsplit(".", 2)[-2] in mspec.mtp_norms}
        vec["norm.weight"] = t[C.MTP_NORM]
        theta, rot, _ = mspec.layer_attention(0)
        rope = rope_tables_bf16(mspec, cap, rot, theta, 0)
        shape = (n, slots, mspec.kv_heads, cap, mspec.head_dim)
        self.k, self.v = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
        fc = (_clinear(C.MTP_FC, art.linears[C.MTP_FC], t), t[C.MTP_ENORM], t[C.MTP_HNORM])
        self.session = core.Session(lib or core.load(), mspec, lin, vec, [rope] * n, list(self.k), list(self.v), cap,
                                    threads=threads, attn_scale=core.attn_scale(mspec), embed_mult=spec.embed_mult or 0.0,
                                    pinned=True, fc=fc)
        self.slots, self.cap, self.slot_elems = slots, cap, mspec.kv_heads * cap * mspec.head_dim
        self.vocab = spec.vocab
        # a draft step's bytes: the block's tensors and the head as a decode step reads it
        self.step_bytes = sum(decode_read_bytes(k, int(a.nbytes), int(a.shape[0])) for k, a in t.items()
                              if len(a.shape) and k.startswith(("mtp.", C.ROLE_LM_HEAD + ".")))


def _clinear(name: str, e, t: dict) -> core.CLinear:
    return core.clinear(e.kind, e.n, e.k, e.group_size, lambda s: t.get(f"{name}.{s}"))


class MtpDrafter:
    """Drafts from an MtpBlock for a target whose Session it taps (``target_slot_elems``: the offset
    between the target's KV slots). Greedy: the block's best token per row."""
    name = "mtp"

    def __init__(self, block: MtpBlock, target_session, target_slot_elems: int, cost: float):
        self.b, self.s = block, block.session
        self.hidden = [dict() for _ in range(block.slots)]  # per slot: position -> the model's hidden state there
        self.fed = [[] for _ in range(block.slots)]  # per slot: tokens whose pairs (h_p, token p + 1) it holds
        self.tslot = target_slot_elems
        self.cost, self.give_up = cost, GIVE_UP  # DraftLength: a block whose probes keep failing stops drafting
        target_session.tap = self._tap

    def _tap(self, kvoff: int, pos0: int, rows: np.ndarray) -> None:
        h = self.hidden[kvoff // self.tslot]
        if pos0 == 0:
            h.clear()  # a new sequence in the slot
        for j in range(rows.shape[0]):
            h[pos0 + j] = rows[j]

    def warm(self, slot: int, ids: list[int]) -> None:
        """(the prompt's pairs are taken with the first proposal)"""

    def _catch_up(self, slot: int, ids: list[int], keep: int) -> int:
        """feed the slot's pending pairs through the prompt path but the last ``keep`` (rows of the
        first draft step; keep 0: no draft now, so the pairs wait for the next draft, up to HOLD_PAIRS
        of them); returns how many are left for the step, or -1 where a hidden state is missing
        (then no drafts for the sequence)"""
        N, h, kv = len(ids) - 1, self.hidden[slot], slot * self.b.slot_elems
        c = min(max(0, common_prefix(self.fed[slot], ids) - 1), N)
        for p in [p for p in h if p < c]:
            del h[p]
        if any(p not in h for p in range(c, N)):
            self.fed[slot] = []
            return -1
        upto = N - min(N - c, keep)
        if not keep and N - c <= HOLD_PAIRS:
            self.fed[slot] = ids[:c + 1]
            return 0
        if upto > c:
            self.s.prefill(ids[c + 1:upto + 1], c, kvoff=kv, hin=np.stack([h.pop(p) for p in range(c, upto)]))
        self.fed[slot] = ids[:upto + 1]
        return N - upto

    def propose_many(self, asks: list[tuple]) -> list[list[int]]:
        """asks: (slot, ids, k) per sequence; each sequence's k greedy drafts after ids"""
        out = {slot: [] for slot, _, _ in asks}
        live = []
        for slot, ids, k in asks:
            k = min(k, self.b.cap - len(ids))
            if len(ids) > 1 and self._catch_up(slot, ids, CATCH_UP_ROWS if k > 0 else 0) > 0 and k > 0:
                live.append((slot, ids, k))
        feed = {}
        for slot, ids, k in live:  # the pairs still pending: rows of the first step
            c, N = len(self.fed[slot]) - 1, len(ids) - 1
            feed[slot] = (ids[c + 1:N + 1], list(range(c, N)), [self.hidden[slot].pop(p) for p in range(c, N)])
            self.fed[slot] = list(ids)
        while live:
            toks, pos, offs, hin, last = [], [], [], [], []
            for slot, ids, _ in live:
                tk, ps, hs = feed[slot]
                toks += tk
                pos += ps
                hin += hs
                offs += [slot * self.b.slot_elems] * len(tk)
                last.append(len(toks) - 1)
            logits = self.s.step_many(toks, pos, offs, hin=np.stack(hin))
            for (slot, ids, k), i in zip(live, last):
                d = int(np.argmax(logits[i]))
                out[slot].append(d)
                feed[slot] = ([d], [pos[i] + 1], [self.s.batch_xn(i)])
            live = [a for a in live if len(out[a[0]]) < a[2] and feed[a[0]][1][0] < self.b.cap]
        return [_below(out[slot], self.b.vocab) for slot, _, _ in asks]


def target_session(target):
    """the target's C-core Session (a LiteModel's, or the torch runtime's fast path), or None"""
    return getattr(target, "session", None) or getattr(getattr(target, "model", None), "fast", None)


def mtp_drafter(target, *, slots: int = 1, threads: int | None = None) -> MtpDrafter:
    """--draft mtp: the target artifact's own MTP block, drafting for ``slots`` sequences"""
    s = target_session(target)
    if s is None:
        raise RuntimeUserError("--draft mtp runs the MTP block through the C core: load a rows32 artifact on a machine "
                               "with a C compiler (or use --draft ngram)")
    info = getattr(target, "info", None)
    if info is None or info.kind != "artifact":
        raise RuntimeUserError("--draft mtp needs a sparkq artifact with an MTP block (convert the checkpoint first)")
    path = info.source
    block = MtpBlock(path, slots=slots, cap=s.cap, threads=threads or s.threads, lib=s.lib,
                     tensors=getattr(target, "tensors", None))
    from .speculate import step_bytes
    theirs = step_bytes(target)
    slot_elems = getattr(target, "slot_elems", None) or s.spec.kv_heads * s.cap * s.spec.head_dim
    return MtpDrafter(block, s, slot_elems, block.step_bytes / theirs if theirs else 0.3)
