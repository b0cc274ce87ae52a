"""Publish an artifact to the Hugging Face Hub: ``sparkq upload`` and ``spark-convert --push-to-hub``.

One repo holds one artifact per CPU layout (``<layout>/`` subfolders, see
``sparkq.formats.repo``) and a generated model card at the root. Each upload is one
commit whose message names the source, the converter version and the layout.
"""
from __future__ import annotations

import json
from pathlib import Path

from sparkq.formats import constants as C
from sparkq.formats.artifact import Artifact, ArtifactError
from sparkq.formats.manifest import sparkq_version
from sparkq.formats.repo import variants_in

from .errors import ConvertError

MEASUREMENTS = "measurements"  # <artifact>/measurements/{memory,bench,fidelity}.json (sparkq ... --save)


def _measured(art_dir: Path) -> dict:
    out = {}
    for kind in ("memory", "bench", "fidelity"):
        p = art_dir / MEASUREMENTS / f"{kind}.json"
        if p.is_file():
            try:
                out[kind] = json.loads(p.read_text())
            except json.JSONDecodeError:
                pass
    return out


def _measured_tables(m: dict) -> list[str]:
    lines = []
    if "memory" in m:
        r = m["memory"]
        lines += ["### Memory (`sparkq memory --save`)", "", "| peak RSS | settled RSS | transient | weights resident | KV cache | load |",
                  "|---|---|---|---|---|---|",
                  f"| {r['peak_mib']:.0f} MiB | {r['settled_mib']:.0f} MiB | {r['transient_mib']:.1f} MiB | "
                  f"{r['ledger']['total']['resident_file'] / 2**20:.1f} MiB | "
                  f"{r['ledger']['categories'].get('kv cache', {}).get('bytes', 0) / 2**20:.1f} MiB | {r['load_s']:.3f} s |", ""]
    if "bench" in m:
        r = m["bench"]
        lines += [f"### Speed (`sparkq bench --save`, {r['threads']} threads, {r['cpu_capability']}, median of {r['passes']})", "",
                  f"| arm | decode tg{r['tg']} tok/s | prefill pp{r['pp']} tok/s | load s |", "|---|---|---|---|"]
        for n, a in r["arms"].items():
            lines.append(f"| {n} | {a['tg_tok_s']['median']:.1f} | {a['pp_tok_s']['median']:.0f} | {a['load_s']['median']:.3f} |")
        lines.append("")
    if "fidelity" in m:
        tf = m["fidelity"]["teacher_forced"]
        g = m["fidelity"]["greedy"]
        lines += ["### Fidelity vs the bf16 source (`sparkq fidelity --save`)", "",
                  "| tokens | top-1 | KL mean | KL p99 | ppl int4 / bf16 | greedy identical |", "|---|---|---|---|---|---|",
                  f"| {tf['tokens']} | {tf['top1_agreement']:.2%} | {tf['kl_mean']:.4f} | {tf['kl_p99']:.4f} | "
                  f"{tf['ppl_artifact']:.2f} / {tf['ppl_reference']:.2f} | {g['identical']}/{g['prompts']} |", ""]
    return lines


def _calibration(c: dict | None) -> str:
    return f", calibrated on {c.get('tokens')} tokens of {c.get('file')}" if isinstance(c, dict) else ""


def model_card(art: Artifact, repo_id: str, variants: list[str], base_model: str | None = None):
    from huggingface_hub import ModelCard, ModelCardData

    s = art.summary()
    src = art.manifest.source or {}
    base = base_model or (src.get("id") if src.get("kind") == "hub" else None)
    data = ModelCardData(
        base_model=base, base_model_relation="quantized" if base else None, library_name="sparkq",
        pipeline_tag="text-generation", tags=["sparkq", "int4", "cpu", *variants],
        license=src.get("license"), license_name=src.get("license_name"), license_link=src.get("license_link"))
    groups = ", ".join(f"{k}: {v} linears" for k, v in s["group_sizes"].items())
    body = [
        f"# {repo_id.split('/')[-1]} (sparkq int4)", "",
        f"An int4 artifact of `{base or src.get('id')}` for [sparkq](https://pypi.org/project/sparkq/): weights already packed "
        "in the byte layout PyTorch's CPU int4 kernel reads, memory-mapped at load with no repack and no copy.", "",
        "```bash", "pip install sparkq", f'sparkq generate {repo_id} "The capital of France is"', "```", "",
        "sparkq downloads only the folder for your CPU's layout. It is **not** loadable with transformers.", "",
        "| | |", "|---|---|",
        f"| layout variants in this repo | {', '.join(variants)} |",
        f"| group sizes | {groups} (asymmetric int4, bf16 scales/zeros) |",
        f"| bits per weight | {s['bits_per_weight']:.3f} overall, {s['bits_per_weight_linears']:.3f} quantized linears |",
        f"| weights file | {s['weights_file_bytes'] / 2**20:.1f} MiB |",
        f"| tied embedding | {'stored once' if s['tied_embeddings'] else 'no'} |",
        f"| method | {s['method']}{_calibration(art.manifest.calibration)} |",
        f"| converter | sparkq {(art.manifest.converter or {}).get('version')} (format {s['format_version']}) |", "",
    ]
    if src.get("text_only"):  # a multimodal source: say what the artifact leaves out
        body += [f"**Text only.** {src['text_only']}: this artifact takes text in and gives text out.", ""]
    tables = _measured_tables(_measured(art.path))
    body += (["## Measured for this artifact", ""] + tables) if tables else \
        ["No measurements were stored with this artifact (`sparkq memory|bench|fidelity ... --save`)."]
    return ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n" + "\n".join(body) + "\n")


def upload(artifact: str, repo_id: str, *, private: bool = False, revision: str | None = None,
           base_model: str | None = None) -> dict:
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        art = Artifact.open(artifact)
    except ArtifactError as e:
        raise ConvertError(str(e)) from None
    if art.verify() is not None:
        raise ConvertError(f"{artifact}: a tensor does not match its digest; run `sparkq verify` and re-convert before uploading")
    api = HfApi()
    layout = art.layout
    src = art.manifest.source or {}
    source = f"{src.get('id')}@{src['revision']}" if src.get("revision") else str(src.get("id"))
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        try:
            existing = api.list_repo_files(repo_id, revision=revision)
        except HfHubHTTPError:
            existing = []
        variants = sorted(set(variants_in(existing)) - {"(root)"} | {layout})
        ops = []
        for f in sorted(Path(artifact).rglob("*")):
            if f.is_file():
                ops.append(CommitOperationAdd(f"{layout}/{f.relative_to(artifact).as_posix()}", str(f)))
        card = model_card(art, repo_id, variants, base_model)
        ops.append(CommitOperationAdd("README.md", str(card).encode()))
        msg = (f"sparkq {sparkq_version()}: {layout} int4 artifact of {source} "
               f"(format {C.FORMAT_VERSION}, method {art.manifest.method})")
        info = api.create_commit(repo_id, operations=ops, commit_message=msg, revision=revision)
    except Exception as e:  # the client raises HTTP, connection (httpx) and validation errors alike
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConvertError(f"upload to {repo_id} failed: {e.__class__.__name__}: {first}") from None
    return {"repo": repo_id, "revision": revision or "main", "variant": layout, "commit": info.oid,
            "commit_message": msg, "files": len(ops), "variants": variants}
