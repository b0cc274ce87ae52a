"""What the CLI prints: tables for people (the ``--json`` output is the raw dicts), PNG charts."""
from __future__ import annotations

import json


class PlotUnavailable(RuntimeError):
    pass


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


def convert_summary(s: dict) -> str:
    src = s["source"]
    rows = [
        ("source", f"{src.get('kind')}: {src.get('id')}" + (f"@{src['revision']}" if src.get("revision") else "")),
        ("output", s["output"]),
        ("family / method", f"{s['family']} / {s['method']}"),
        ("layout", s["layout"]),
        ("tensors", str(s["tensors"])),
        ("source -> artifact", f"{mib(s['source_bytes'])} -> {mib(s['artifact_bytes'])} "
                               f"({s['artifact_bytes'] / max(1, s['source_bytes']):.1%})"),
        ("bits / weight", f"{s['bits_per_weight']:.3f} (whole file, {s['parameters']:,} params)"),
        ("tied embedding", "yes, stored once (lm_head)" if s["tied_embeddings"] else "no (embed + lm_head)"),
        ("group sizes", ", ".join(f"{k}: {v} linears" for k, v in s["group_sizes"].items())),
        ("group size by role", ", ".join(f"{k}={v}" for k, v in s["group_size_by_role"].items())),
    ]
    for role, e in s["rel_error_by_role"].items():
        rows.append((f"rel. error {role}", f"mean {e['mean']:.4f}, max {e['max']:.4f}"))
    if s.get("calibration"):
        c = s["calibration"]
        rows.append(("calibration", f"{c['tokens']} tokens of {c['file']} from char {c['start_char']:,}; "
                                    f"forward {c['forward_seconds']:.1f} s"))
    k = s.get("key_scaling")
    if k:
        rows.append(("key scaling", f"{k['channels_scaled']} of {k['channels']} key channels scaled by 2^-e "
                                    f"(e <= {k['max_exponent']}), queries by 2^e" if k["applied"] else f"none: {k['why']}"))
    rows += [
        ("time", f"{s['seconds']:.1f} s"),
        ("peak RSS (sampled)", f"{s['peak_rss_mib']:.0f} MiB (at start {s['start_rss_mib']:.0f} MiB); anonymous "
                               f"{s['peak_rss_anon_mib']:.0f} MiB (at start {s['start_rss_anon_mib']:.0f} MiB)"),
        ("largest source tensor", f"{s['largest_source_tensor_mib']:.1f} MiB"),
    ]
    return "sparkq conversion summary\n" + table(rows)


def inspect_summary(s: dict) -> str:
    rows = [("artifact", s["path"]), ("format version", str(s["format_version"])), ("layout", s["layout"]),
            ("family / method", f"{s['family']} / {s['method']}"),
            ("tied embedding", str(s["tied_embeddings"])),
            ("source", json.dumps(s["source"])),
            ("group sizes", ", ".join(f"{k}: {v}" for k, v in s["group_sizes"].items())),
            ("weights file", mib(s["weights_file_bytes"])),
            ("bits / weight", f"{s['bits_per_weight']:.3f} overall, {s['bits_per_weight_linears']:.3f} quantized linears")]
    rows += [(f"bytes {k}", mib(v)) for k, v in s["bytes_by_role"].items()]
    rows.append(("key scaling", s["key_scaling"]))
    rows += [(f"encodings {role}", ", ".join(f"{e} x{n}" for e, n in sorted(v.items(), key=lambda kv: -kv[1])))
             for role, v in s["encodings"].items()]
    return table(rows)


def generate_stats(m, rss: dict, threads: int | str) -> str:
    st = m.last_stats
    return (f"[load {m.info.load_seconds:.2f} s | prefill {st.prompt_tokens} tok {st.prefill_tok_s:.1f} tok/s | "
            f"decode {st.new_tokens} tok {st.decode_tok_s:.1f} tok/s | "
            + (f"drafted {st.drafted}, accepted {st.accepted} ({st.accepted / st.drafted:.0%}) in {st.passes} passes | "
               if st.drafted else "") +
            f"RSS anon {rss['RssAnon']:.0f} MiB + "
            f"file {rss['RssFile']:.0f} MiB (peak {rss['VmHWM']:.0f}) | threads {threads} | "
            f"layout {m.info.layout or 'bf16 checkpoint'} | decode path {m.info.extra.get('decode_path', '?')} | "
            f"prefill path {m.info.extra.get('prefill_path', '?')}]")


def memory_summary(artifact: str, r: dict) -> str:
    lines = [f"sparkq memory: {artifact}  ({', '.join(f'{k}={v}' for k, v in r['settings'].items())})", "",
             f"  {'category':16} {'regions':>7} {'bytes':>12} {'resident':>12} {'file':>12} {'anon':>12}"]
    rows = list(r["ledger"]["categories"].items()) + [("total", r["ledger"]["total"])]
    for k, c in rows:
        lines.append(f"  {k:16} {c['regions']:>7} {mib(c['bytes']):>12} {mib(c['resident']):>12} "
                     f"{mib(c['resident_file']):>12} {mib(c['resident_anon']):>12}")
    lines += ["", f"  {'stage':18} {'RssAnon':>10} {'RssFile':>10} {'PSS':>10}"]
    for s in r["stages"]:
        lines.append(f"  {s['stage']:18} {s['rss_anon_mib']:>7.1f} MiB {s['rss_file_mib']:>6.1f} MiB {s['pss_mib']:>6.1f} MiB")
    lines += ["", f"  import cost: torch {r['import_cost_mib']['torch']:.1f} MiB, sparkq {r['import_cost_mib']['sparkq']:.1f} MiB",
              f"  load + warm-up: peak {r['peak_mib']:.1f} MiB, settled {r['settled_mib']:.1f} MiB, "
              f"transient {r['transient_mib']:.1f} MiB (sampled every 2 ms); load {r['load_s']:.3f} s"]
    return "\n".join(lines)


def fidelity_summary(artifact: str, reference: str, prefill: str, r: dict) -> str:
    tf, g = r["teacher_forced"], r["greedy"]
    return f"sparkq fidelity: {artifact} vs {reference}\n" + table([
        ("tokens (teacher-forced)", f"{tf['tokens']} in windows of {r['window']} (prefill {prefill})"),
        ("top-1 agreement", f"{tf['top1_agreement']:.2%}"),
        ("KL(ref || artifact)", f"mean {tf['kl_mean']:.4f}, p99 {tf['kl_p99']:.4f}"),
        ("perplexity", f"artifact {tf['ppl_artifact']:.3f}, reference {tf['ppl_reference']:.3f}"),
        ("greedy identical", f"{g['identical']}/{g['prompts']} ({g['new_tokens']} tokens each)"),
        ("mean first divergence", f"{g['mean_first_divergence']:.1f} tokens"),
    ]) + f"\n  note: {g['caveat']}"


def format_bench(r: dict) -> str:
    lines = [f"sparkq bench: {r['model']}", f"  threads {r['threads']}, OMP_WAIT_POLICY {r['omp_wait_policy']}, "
             f"cpu {r['cpu_capability']}, {r['passes']} interleaved passes, medians [min..max]; "
             f"read ceiling {r['read_ceiling_gb_s']:.1f} GB/s"
             + (f" [{r['read_ceiling']['min']:.1f}..{r['read_ceiling']['max']:.1f}], probed before each arm's run; % ceiling = "
                "median over passes of a run's GB/s over its own probe; ratios = medians of same-pass ratios" if "read_ceiling" in r else ""),
             "",
             f"  | arm | decode tg{r['tg']}{' @ d' + str(r['depth']) if r.get('depth') else ''} tok/s | prefill pp{r['pp']} tok/s | load s | TTFT s | peak / settled RSS MiB "
             f"| run peak / after RSS MiB (bound) | decode GB/s (% ceiling) | decode vs control | prefill vs control "
             f"| decode path; prefill path |", "  |---|---|---|---|---|---|---|---|---|---|---|"]
    for n, a in r["arms"].items():
        def f(m, fmt):
            return f"{format(a[m]['median'], fmt)} [{format(a[m]['min'], fmt)}..{format(a[m]['max'], fmt)}]"
        lines.append(f"  | {n} | {f('tg_tok_s', '.1f')} | {f('pp_tok_s', '.0f')} | {f('load_s', '.3f')} | {f('ttft_s', '.3f')} "
                     f"| {a['peak_rss_mib']['median']:.0f} / {a['settled_rss_mib']['median']:.0f} "
                     f"| {a['run_peak_rss_mib']['max']:.0f} / {a['after_run_rss_mib']['median']:.0f}"
                     f"{' (' + format(a['rss_bound_mib'], '.0f') + ')' if 'rss_bound_mib' in a else ''} "
                     f"| {a['decode_gb_s']:.1f} ({a['decode_pct_of_ceiling']:.0f}%) | {a['ratio_to_control']['tg_tok_s']:.2f}x "
                     f"| {a['ratio_to_control']['pp_tok_s']:.2f}x | {a.get('decode_path', '?')}"
                     f"{'; prefill ' + a['prefill_path'] if a.get('prefill_path') else ''}"
                     f"{'; KV ' + a['kv_dtype'] if a.get('kv_dtype') else ''}"
                     f"{'; depth ' + str(a['depth']) if a.get('depth') != r.get('depth') else ''} |")
    return "\n".join(lines)


def format_bench_serve(r: dict) -> str:
    st = r["settings"]
    arms = list(r["summary"])
    lines = [f"sparkq bench-serve: {st['passes']} interleaved passes, medians [min..max]; {st['max_tokens']} new tokens "
             f"per request, {st['per_client']} requests per client per level; C-core builds: "
             + ", ".join(f"{n} {b or 'n/a'}" for n, b in r.get("builds", {}).items()), "",
             "  | arm | streams | aggregate tok/s | vs 1 stream | vs " + arms[0] + " | TTFT p50 / p95 s | ITL p50 / p95 ms | errors |",
             "  |---|---|---|---|---|---|---|---|"]
    for n in arms:
        one = r["summary"][n].get(min(r["summary"][n]))["agg_tok_s"]
        for c, m in r["summary"][n].items():
            base = r["summary"][arms[0]][c]["agg_tok_s"]
            lo, hi = m["agg_tok_s_range"]
            lines.append(f"  | {n} | {c} | {m['agg_tok_s']:.1f} [{lo:.1f}..{hi:.1f}] | {m['agg_tok_s'] / one:.2f}x "
                         f"| {m['agg_tok_s'] / base:.2f}x | {m['ttft_p50_s']:.2f} / {m['ttft_p95_s']:.2f} "
                         f"| {m['itl_p50_ms']:.0f} / {m['itl_p95_ms']:.0f} | {m['errors']} |")
    return "\n".join(lines)


def plot(path: str, title: str, groups: dict[str, dict[str, float]], ylabel: str) -> None:
    """A grouped bar chart as PNG (matplotlib, optional: `pip install matplotlib`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib") from None
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (name, vals) in zip(axes[0], groups.items()):
        ax.bar(list(vals), list(vals.values()), color="#4c72b0")
        ax.set_title(name)
        ax.set_ylabel(ylabel if ax is axes[0][0] else "")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
