"""What a conversion records: the manifest's per-tensor entries and the summary spark-convert
prints (``--json``: the same dict)."""
from __future__ import annotations

from pathlib import Path

from sparkq.formats import constants as C
from sparkq.formats.kinds import role_of


def tensor_meta(digests: dict, by_name: dict, srcs: dict) -> dict:
    """The manifest's tensors: digest, role, and the linear or the sources each belongs to."""
    out = {}
    for n, d in digests.items():
        owner, _, part = n.rpartition(".")
        if owner in by_name:
            out[n] = {"sha256": d, "role": f"{role_of(owner)}.{part}", "linear": owner}
        else:
            out[n] = {"sha256": d, "role": part if part == "bias" else "norm", "sources": srcs[n]}
    return out


def summary(*, source, out: str, recipe, layout: str, opts, cal_info, cal_seconds: float, budget_info, key_info,
            entries: list, srcs: dict, linears: list, vectors: dict, errors: dict, spec, carried: list,
            art_bytes: int, seconds: float, mem) -> dict:
    groups: dict[str, list[str]] = {}
    for lin in linears:
        groups.setdefault(lin.group_label, []).append(lin.name)
    params = sum(lin.n * lin.k for lin in linears) + sum(s[0] for s in vectors.values())
    kind = {lin.name: lin.kind for lin in linears}
    by_role: dict[str, list[float]] = {}
    for n, e in errors.items():  # (in file order)
        if kind[n] != C.KIND_BF16:
            by_role.setdefault(role_of(n), []).append(e)
    return {
        "source": source.origin,
        "output": str(Path(out).absolute()),
        "family": recipe.family,
        "layout": layout,
        "method": opts.method,
        "calibration": cal_info and {**cal_info, "forward_seconds": cal_seconds},
        "budget": budget_info,
        "key_scaling": key_info,
        "tensors": len(entries),
        "source_bytes": sum(source.nbytes(p) for names in srcs.values() for p in names),
        "artifact_bytes": art_bytes,
        "bits_per_weight": 8 * art_bytes / params,
        "parameters": params,
        "tied_embeddings": spec.tied,
        "group_sizes": {g: len(v) for g, v in groups.items()},
        "group_size_by_role": {role_of(lin.name): (lin.group_size or lin.kind) for lin in linears},
        "rel_error_by_role": {r: {"mean": sum(v) / len(v), "max": max(v)} for r, v in by_role.items()},
        "carried_files": carried,
        "seconds": seconds,
        "peak_rss_mib": mem.peak_kib / 1024,
        "start_rss_mib": mem.start_kib / 1024,
        "peak_rss_anon_mib": mem.peak_anon_kib / 1024,
        "start_rss_anon_mib": mem.start_anon_kib / 1024,
        "largest_source_tensor_mib": max(source.nbytes(p) for names in srcs.values() for p in names) / 2**20,
    }
