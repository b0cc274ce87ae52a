"""spark-convert's options and how each resolves: the method (auto -> gptq or clip), the bit budget
(auto -> default_bpw, or one encoding everywhere), the target layout."""
from __future__ import annotations

from dataclasses import dataclass, replace

from sparkq.formats.kinds import KINDS
from sparkq.formats.layout import LAYOUTS, ROWS32, LayoutError, host_layout

from .errors import ConvertError

HEAD_MODES = (*KINDS, "split")  # --head (split: int4 + a 4-bit residual plane)
BODY_KINDS = tuple(k for k, w in KINDS.items() if w.grouped)  # --kind: the 4-bit codes
# SPLIT_DEFAULT: without --head, on the rows32 target (the C core's), a head/embedding the recipe
# keeps in int8 is stored split instead: the same ~8-bit precision (example, 2048 tokens of
# wikitext-2 against bf16: KL 0.1343 vs 0.1341, top-1 81.93% vs 81.59%, ppl 21.69 vs 21.77), and
# the decode step reads the 4-bit plane: 1.7B shape decode +15% (docs/quality.md "Split head"). Other
# targets (torch's int4 layouts, whose runtime gathers the refined rows slowly) keep int8.
# The budget a plain `spark-convert SRC OUT` spends (docs/quality.md "Bit budget"): 4.55 bits/weight
# from 1B parameters (Qwen2.5-Coder-1.5B: KL 0.022 vs llama.cpp IQ4_XS+imatrix's 0.035 at 4.59), 5.0
# below, where the tied head is a fifth of the weights and a bit buys more (SmolLM2-135M: KL 0.028 at
# 5.0; 0.10 at 4.65 with the earlier estimates) while the file stays small (84 MB)
DEFAULT_BPW, DEFAULT_BPW_SMALL, SMALL_PARAMS = 4.55, 5.0, 1_000_000_000


def default_bpw(params: int) -> float:
    return DEFAULT_BPW_SMALL if params < SMALL_PARAMS else DEFAULT_BPW


@dataclass
class Options:
    group_size: int | None = None  # None: the recipe's [quant] group_size
    target: str = "rows32"
    recipe: str | None = None
    method: str = "auto"  # auto: gptq when the source has a tokenizer (calibration text to read), else clip
    force: bool = False
    progress: bool = True
    head: str | None = None  # None: the recipe decides; int4 | int8 | bf16 | split for lm_head and embed
    calib: str | None = None  # calibration text for gptq; None: the bundled text (convert/data/calibration.txt)
    calib_tokens: int = 8192
    kind: str | None = None  # the body linears' 4-bit codes: int4 (uniform; None) or lut4 (a learned table per row)
    # bits per weight of the whole file, spent per linear (convert/budget.py); "auto": default_bpw()
    # unless --kind / --head / --group-size ask for one encoding everywhere (then None: uniform)
    bpw: float | str | None = None
    # powers of two moved from the keys' large channels onto the queries' (convert/keyscale.py):
    # the same q.k, flatter rows for the int8 KV cache
    key_scaling: bool = True
    # --head split only: the share of lm_head's rows that get the second plane (a partial split,
    # convert/headrows.py: the rows of the most probable tokens on the calibration text); None: all
    head_rows: float | None = None
    # keep a multi-token-prediction block the checkpoint ships (Qwen3.5's mtp.*: --draft mtp), 4-bit, uncalibrated
    mtp: bool = True


def target_layout(target: str) -> str:
    if target == "native":
        try:
            return host_layout()
        except LayoutError as e:
            raise ConvertError(f"{e}; pass --target rows32|avx512|avx2|default") from None
    if target not in LAYOUTS:
        raise ConvertError(f"unknown --target {target!r}; choose native, {', '.join(LAYOUTS)}")
    return target


def resolve_budget(opts: Options) -> Options:
    """"auto" stays "auto" (default_bpw of the planned model) for a plain rows32 conversion and
    becomes None (one encoding everywhere) when --kind / --head / --group-size choose one; an
    explicit --bpw is checked against them."""
    uniform = opts.kind is not None or opts.head is not None or opts.group_size is not None
    if opts.bpw == "auto":
        return replace(opts, bpw=None) if uniform or opts.target != ROWS32 else opts
    if opts.bpw is None:
        return opts
    if uniform:
        raise ConvertError("--bpw chooses each linear's encoding; drop --kind / --head / --group-size, or drop --bpw "
                           "for one encoding everywhere")
    if opts.target != ROWS32:
        raise ConvertError("--bpw mixes lut4 and split linears, which only the C core reads: use --target rows32")
    if not isinstance(opts.bpw, (int, float)) or not 2.0 <= float(opts.bpw) <= 16.0:
        raise ConvertError(f"--bpw {opts.bpw}: give bits per weight between 2 and 16 (e.g. 4.5)")
    return opts


def resolve_method(opts: Options, source) -> Options:
    """auto: gptq (calibrated on --calib or the bundled text) when the source's tokenizer can
    read calibration text, else the calibration-free clip search."""
    from .calib import has_tokenizer, uncalibrated

    why = uncalibrated(source.config)
    if opts.method != "auto":
        if why and opts.method in ("gptq",):
            raise ConvertError(f"--method {opts.method}: the calibration forward does not run {why} yet; use --method clip")
        return opts
    return replace(opts, method="gptq" if (opts.calib or has_tokenizer(source)) and not why else "clip")
