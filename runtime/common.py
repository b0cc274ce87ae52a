"""The parts of loading shared by the torch runtime (api.py) and the torch-free one (lite.py):
source resolution, KV budget -> capacity, the load record, the allocator setting. No torch here."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .hub import is_repo_id
from sparkq.formats.mixers import state_bytes
from sparkq.formats.spec import ModelSpec

from .errors import RuntimeUserError

DEFAULT_KV_BUDGET_MIB = 192
DEFAULT_MAX_MODEL_LEN = 2048
REFINE_TOP = 8  # top logits recomputed in fp32 per position (see Model._refine_top)
# a split head (formats/constants.py): the head product reads its first plane only, and this many
# top logits per position are recomputed from both planes. Example, 2048 teacher-forced tokens,
# KL against bf16 with the screen's top k recomputed: 0.1413 (16), 0.1385 (64), 0.1365 (256),
# 0.1352 (1024), 0.1347 (2048), 0.1343 (4096), 0.1339 (all); the int8 head 0.1340 (docs/quality.md
# "Split head"; re-measure: `spark-convert SRC OUT --head split`, then `sparkq fidelity OUT --reference SRC
# --corpus ../shared/corpus/wikitext2-valid.txt --tokens 2048` with this constant set per run)
REFINE_SPLIT = 2048


def decode_read_bytes(name: str, nbytes: int, rows: int) -> int:
    """Bytes of an artifact tensor one decode step reads: all of it, except a split head's second
    plane (only its REFINE_SPLIT refined rows) and an untied embedding (one row per token, ~0)."""
    if name.startswith("embed."):
        return 0
    if name.endswith((".residual", ".residual_scales", ".residual_map")):
        return nbytes * min(REFINE_SPLIT, rows) // rows
    return nbytes


# the KV cache's element types (load(kv_dtype=...), --kv-dtype): bf16, or int8 codes with one bf16
# scale per (position, KV head), written by the decode step and the prompt path alike
KV_DTYPES = ("bf16", "int8")
DEFAULT_KV_DTYPE = "int8"


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise RuntimeUserError(f"KV cache dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}; pass --kv-dtype bf16 or int8")
    return kv_dtype


def core_lacks(spec: ModelSpec) -> str | None:
    """What of the model the C core does not run yet (None: all of it)."""
    if spec.attn_gate and spec.head_dims:
        return "an attention output gate with per-layer head dims is not in the C core"
    return None


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str = DEFAULT_KV_DTYPE) -> int:
    """K and V of one position in every layer, as both runtimes allocate them: bf16 rows, or
    int8 rows and one bf16 scale each."""
    bf16 = check_kv_dtype(kv_dtype) == "bf16"
    return 2 * spec.kv_heads * sum(spec.hd(i) * 2 if bf16 else spec.hd(i) + 2 for i in spec.kv_layers)


@dataclass
class LoadInfo:
    source: str
    kind: str  # "artifact" | "bf16"
    layout: str | None
    load_seconds: float
    kv_capacity: int
    kv_bytes: int
    rope_bytes: int
    max_model_len: int
    extra: dict = field(default_factory=dict)


def resolve(path_or_repo: str, layouts: list[str] | None = None) -> tuple[Path, dict]:
    p = Path(path_or_repo)
    if p.exists():
        return p, {}
    if is_repo_id(path_or_repo):
        from .hub import download_artifact
        return download_artifact(path_or_repo, layouts)
    raise RuntimeUserError(f"{path_or_repo}: no such directory (and not a Hub repo id org/name[@revision])")


def by_layer(spec: ModelSpec, caches) -> list | None:
    """Per layer: its slice of a cache array over the attention layers (spec.kv_layers), None for a
    layer without KV (another mixer); a KV-sharing layer: its source layer's; None stays None."""
    if caches is None:
        return None
    index = {layer: j for j, layer in enumerate(spec.kv_layers)}
    src = spec.kv_from or range(spec.layers)
    return [caches[index[src[i]]] if src[i] in index else None for i in range(spec.layers)]


def kv_capacity(spec: ModelSpec, max_model_len: int, kv_budget_mib: float, kv_dtype: str = DEFAULT_KV_DTYPE) -> int:
    if max_model_len <= 0:
        raise RuntimeUserError(f"max_model_len must be positive, got {max_model_len}")
    if kv_budget_mib <= 0:
        raise RuntimeUserError(f"kv_budget_mib must be positive, got {kv_budget_mib}")
    if max_model_len > spec.max_position:
        raise RuntimeUserError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                               f"{spec.max_position}; lower --max-model-len")
    per_tok = kv_bytes_per_token(spec, kv_dtype)
    state = state_bytes(spec)  # a sequence's recurrent state (hybrid models), fixed, out of the same budget
    cap = min(max_model_len, max(0, int(kv_budget_mib * 2**20) - state) // max(1, per_tok))
    if cap < 1:
        raise RuntimeUserError(f"a KV budget of {kv_budget_mib} MiB holds no token ({per_tok} bytes each"
                               + (f", after the sequence's {state / 2**20:.1f} MiB recurrent state" if state else "")
                               + "); raise --kv-budget-mib")
    return cap


# glibc serves allocations above its mmap threshold with mmap and returns them on free, but the
# threshold grows (up to 32 MiB) after such frees, so prefill's multi-MiB activations end up on
# the heap and stay resident. Fixed at 1 MiB: peak RSS through pp512 + tg64 at the Qwen3-1.7B
# shape 1357 -> 1344 MiB, after it 1340 -> 1320 (/proc/self/status sampled every 2 ms; 256 KiB
# gave the same, 4 MiB 1358 / 1327).
MALLOC_MMAP_THRESHOLD = 1 << 20


def fix_malloc_mmap_threshold() -> bool:
    """mallopt(M_MMAP_THRESHOLD, 1 MiB) on glibc (process-wide; also stops the growth above)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(-3, MALLOC_MMAP_THRESHOLD))  # -3 = M_MMAP_THRESHOLD


def check_fits(total_tokens: int, max_model_len: int, kv_capacity: int) -> None:
    """A request of total_tokens (prompt + generation) must fit min(max_model_len, the KV cache)."""
    capacity = min(kv_capacity, max_model_len)
    if total_tokens > capacity:
        which = ("max_model_len", "--max-model-len") if max_model_len <= kv_capacity else ("KV budget", "--kv-budget-mib")
        raise RuntimeUserError(
            f"{total_tokens} tokens (prompt + generation) exceed the {which[0]} capacity of {capacity} tokens; "
            f"shorten the prompt, lower --max-new-tokens, or raise {which[1]}")


def check_ids(ids, vocab: int) -> None:
    """Token ids must index the embedding (the C core reads the row without a check): an int, or
    (min, max) of a prompt."""
    lo, hi = (ids, ids) if isinstance(ids, int) else ids
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise RuntimeUserError(f"token id {bad} is outside the vocabulary (0..{vocab - 1}); "
                               "pass ids from this model's tokenizer")
