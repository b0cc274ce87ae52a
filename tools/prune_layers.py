"""A layer-pruned copy of a bf16 HF checkpoint: a draft model for speculative decoding where no
smaller sibling with the same tokenizer is at hand (docs/performance.md "Speculation"). Keeps the
embedding, the head, the final norm and the listed decoder layers (renumbered), and writes a
checkpoint spark-convert reads; the tokenizer files are copied.

  python tools/prune_layers.py SRC_DIR OUT_DIR --keep 0-7,10,13,16,19,22,24-27
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path


def parse_keep(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return sorted(set(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--keep", required=True, help="layers to keep, e.g. 0-7,10,13,24-27")
    a = ap.parse_args()
    from safetensors import safe_open
    from safetensors.torch import save_file
    src, out = Path(a.src), Path(a.out)
    cfg = json.loads((src / "config.json").read_text())
    keep = parse_keep(a.keep)
    if not keep or keep[-1] >= cfg["num_hidden_layers"]:
        raise SystemExit(f"--keep must name layers 0..{cfg['num_hidden_layers'] - 1}")
    new = {old: i for i, old in enumerate(keep)}
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                m = re.match(r"(.*\blayers\.)(\d+)(\..*)", name)
                if m is None:
                    tensors[name] = sf.get_tensor(name)
                elif int(m.group(2)) in new:
                    tensors[f"{m.group(1)}{new[int(m.group(2))]}{m.group(3)}"] = sf.get_tensor(name)
    out.mkdir(parents=True, exist_ok=False)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_hidden_layers"] = len(keep)
    for key in ("layer_types", "max_window_layers"):
        if isinstance(cfg.get(key), list):
            cfg[key] = [cfg[key][i] for i in keep]
    if isinstance(cfg.get("max_window_layers"), int):
        cfg["max_window_layers"] = len(keep)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "special_tokens")) or f.name.endswith((".jinja", ".txt")):
            shutil.copy(f, out / f.name)
    print(f"{out}: layers {keep} of {len(new) and cfg['num_hidden_layers']} kept ({len(tensors)} tensors)")


if __name__ == "__main__":
    main()
