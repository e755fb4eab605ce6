"""The end-to-end benchmark's document (e2e_vllm.py): the engines' log-probabilities against
the reference engine's, the variants and TP / EP engines against their base, the targets, the
table, the plot, and --merge of several runs' JSON into one document."""
from __future__ import annotations

import json
import os
import re

LP_PROMPT_LEN, LP_GEN = 128, 32       # log-probability sequence: prompt + greedy tokens


def parallel(name: str) -> tuple[str, int, bool]:
    """(TP1 base config, tensor_parallel_size, expert parallel) of an engine name X, X@tpN or
    X@epN (a suffix --merge appended after it stays on the base: X@tp2_seqs256 -> X_seqs256)."""
    m = re.fullmatch(r"(.+?)@(tp|ep)(\d+)(.*)", name)
    return (m[1] + m[4], int(m[3]), m[2] == "ep") if m else (name, 1, False)


def is_moe(model: dict) -> bool:
    """Whether ``model`` (a run's shape, or a saved header's) is the MoE one."""
    return "num_experts" in model


def logprob_reference(model: dict) -> str:
    """The engine the others' log-probabilities are compared with: BF16, or for the MoE
    model (whose BF16 engine runs dummy weights) vLLM's fp8 on the same FP8 checkpoint."""
    return "fp8_cutlass" if is_moe(model) else "bf16"


def logprob_deltas(r: dict, ref: dict, ref_name: str) -> dict:
    """Engine result `r` against `ref` on the sequence both scored: |delta logprob| of the
    prompt tokens and of the greedy tokens after them, top-1 agreement, own greedy tokens."""
    n_prompt = LP_PROMPT_LEN - 1          # tf_logprobs[i] scores seq[i + 1]
    # the same sequence scored: the prompt + bf16's greedy tokens, when bf16 ran first in
    # the same invocation; else (bf16 run apart, --merge) the prompt part alone compares.
    # (A saved run keeps tf_seq for bf16 only; tf_source says whose tokens were scored.)
    if "tf_seq" in r and "tf_seq" in ref:
        same = r["tf_seq"] == ref["tf_seq"]
        if not same and r["tf_seq"][:LP_PROMPT_LEN] != ref["tf_seq"][:LP_PROMPT_LEN]:
            return {"error": f"scored a different sequence than {ref_name}"}
    else:   # (bf16 itself scored its own tokens: tf_source "own")
        same = all(x.get("tf_source", "bf16") == "bf16" or x.get("name") == "bf16"
                   for x in (r, ref))
    n = len(r["tf_logprobs"]) if same else n_prompt
    d = [abs(a - b) for a, b in zip(r["tf_logprobs"][:n], ref["tf_logprobs"][:n])]
    dp, dg = d[:n_prompt], d[n_prompt:]
    top = [a == b for a, b in zip((r.get("tf_top1") or [])[:n], (ref.get("tf_top1") or [])[:n])]
    g1, g0 = r.get("greedy_tokens") or [], ref.get("greedy_tokens") or []
    return {
        "greedy_abs_dlogprob_mean": sum(dg) / len(dg) if dg else None,
        "greedy_abs_dlogprob_max": max(dg) if dg else None,
        "prompt_abs_dlogprob_mean": sum(dp) / len(dp) if dp else None,
        "prompt_abs_dlogprob_max": max(dp) if dp else None,
        "top1_agreement": sum(top) / len(top) if top else None,
        "scored": "prompt + bf16's greedy tokens" if same else "prompt only",
        "greedy_tokens_equal": g1 == g0,
        "greedy_first_divergence": next((i for i, (a, b) in enumerate(zip(g1, g0)) if a != b),
                                        None),
    }


def compare_logprobs(results: dict, model: dict) -> dict:
    """Each engine's log-probabilities against logprob_reference(model)'s."""
    ref_name = logprob_reference(model)
    ref = results.get(ref_name)
    out = {}
    if not ref or "tf_logprobs" not in ref:
        return out
    n_prompt = LP_PROMPT_LEN - 1
    for name, r in results.items():
        # (bf16@tpN: against bf16 under parallel_vs_tp1; the MoE model's runs dummy weights)
        if name == ref_name or parallel(name)[0] == "bf16" or "tf_logprobs" not in r:
            continue
        out[name] = logprob_deltas(r, ref, ref_name)
        if "error" not in out[name]:
            out[name]["bf16_greedy_logprob_mean"] = (sum(ref["tf_logprobs"][n_prompt:])
                                                     / max(1, len(ref["tf_logprobs"][n_prompt:])))
    return out


# fp8_blockgemm against itself with one of the plugin's compile changes off
VARIANTS = {"pdl_vs_nopdl": ("fp8_blockgemm_nopdl", "Inductor PDL on vs off"),
            "fuse_vs_nofuse": ("fp8_blockgemm_nofuse", "quantization fusion pass on vs off")}


def compare_variant(results: dict, other: str, base: str = "fp8_blockgemm") -> dict:
    """`base` and `other` compute the same model on the same data: fp8_blockgemm and itself
    with Inductor's PDL off or with the quantization fusion pass off, or X and X@tpN / X@epN
    (TP1 vs split over GPUs). Their greedy tokens and log-probabilities are compared (a missed
    wait would show here; so do rounding changes, e.g. the fused kernels' or a TP all-reduce's,
    and Inductor's compile-time choices, which can differ between engine processes); without a
    bf16 engine each scores its own greedy tokens: the prompt only."""
    a, b = results.get(base, {}), results.get(other, {})
    if "tf_logprobs" not in a or "tf_logprobs" not in b:
        return {}
    return logprob_deltas(b, a, base)


def compare_variants(engines: dict) -> dict:
    """{VARIANTS key: compare_variant} and parallel_vs_tp1: {X@tpN / X@epN: compare_variant
    with its TP1 engine X}, for the document."""
    out = {key: compare_variant(engines, other) for key, (other, _) in VARIANTS.items()}
    out["parallel_vs_tp1"] = {}
    for name, r in engines.items():
        base = parallel(name)[0]
        if base == name:
            continue
        if base not in engines:
            c = {"error": f"no TP1 engine {base} in this run"}
        elif "dummy" in (r.get("llm_kwargs", {}).get("load_format"),
                         engines[base].get("llm_kwargs", {}).get("load_format")):
            # vLLM draws dummy weights per GPU's shard: not the TP1 engine's model
            c = {"error": "dummy weights differ between TP sizes: not compared"}
        else:
            c = compare_variant(engines, name, base) or {"error": "no log-probabilities"}
        out["parallel_vs_tp1"][name] = c
    return out


def decode_rows(engines: dict) -> list:
    """The JSON's flat rows: one per engine and decode batch."""
    return [{"config": name, "batch": d["batch"], "per_token_ms": d["per_token_ms"],
             "decode_tok_s": d["decode_tok_s"]}
            for name, r in engines.items() for d in r.get("decode", []) if d.get("per_token_ms")]


def merge(paths, out) -> int:
    """--merge: one document from several runs' JSON (their headers listed under
    header.merged_from)."""
    docs = []
    for path in paths:
        # PATH@SUFFIX: that run's engines get SUFFIX appended to their names (e.g. an engine
        # run with other settings, kept beside the one of the same name); PATH@SUFFIX:A,B
        # renames engines A and B only
        path, _, suffix = path.partition("@")
        suffix, _, only = suffix.partition(":")
        only = set(only.split(",")) if only else None
        with open(path) as f:
            d = json.load(f)
        names = {n: n + suffix if only is None or n in only else n for n in d["engines"]}
        d["engines"] = {names[n]: dict(e, name=names[n]) for n, e in d["engines"].items()}
        if "bf16" not in d["engines"]:    # (runs saved before tf_source: own greedy tokens)
            for e in d["engines"].values():
                e.setdefault("tf_source", "own")
        docs.append(d)
    keys = ("model", "prompt_len", "out_len", "compile")
    for d in docs[1:]:
        diff = [k for k in keys if d["header"].get(k) != docs[0]["header"].get(k)]
        if diff:
            raise SystemExit(f"--merge: {diff} differ between {paths[0]} and the others")
    doc = {"header": dict(docs[0]["header"]), "engines": {}}
    doc["header"]["merged_from"] = [
        {"file": os.path.basename(p.partition("@")[0]), "date": d["header"].get("date"),
         "engines": list(d["engines"]), "batches": d["header"].get("batches")}
        for p, d in zip(paths, docs)]
    for d in docs:
        doc["engines"].update(d["engines"])
    # runs may time different batch sizes (--b256): the table shows each engine's own
    batches = sorted({b for d in docs for b in d["header"]["batches"]})
    doc["header"]["batches"] = batches
    model = doc["header"].get("model")
    doc["logprobs"] = compare_logprobs(doc["engines"], model)
    doc.update(compare_variants(doc["engines"]))
    doc["targets"] = targets(doc["engines"], batches, model)
    doc["rows"] = decode_rows(doc["engines"])
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, os.path.splitext(out)[0] + ".png")
    print(table(doc))
    return 0


def model_name(model: dict) -> str:
    """What the header's model is, in words (the full model's layer count noted)."""
    moe = is_moe(model)
    full = 48 if moe else 32
    arch = "Qwen3-30B-A3B" if moe else "Llama-3.1-8B"
    if model.get("shape", "").startswith("tiny"):  # (--shape tiny, tiny_moe)
        return f"{model['layers']}-layer {model['shape']} model (a small {arch}-architecture one)"
    return (f"{model['layers']}-layer {arch}-shaped model"
            f"{'' if model['layers'] == full else f' (NOT the {full}-layer model)'}")


def lp_words(c: dict) -> str:
    """A logprob_deltas comparison in one line of the table."""
    if not c or c.get("error"):
        return (c or {}).get("error", "-")
    parts = [f"{k} |dlogprob| mean/max {c[k + '_abs_dlogprob_mean']:.3f}/"
             f"{c[k + '_abs_dlogprob_max']:.3f}" for k in ("greedy", "prompt")
             if c.get(k + "_abs_dlogprob_mean") is not None]
    if c.get("top1_agreement") is not None:
        parts.append(f"top-1 agreement {c['top1_agreement']:.3f}")
    div = c.get("greedy_first_divergence")
    parts.append("greedy tokens equal" if c.get("greedy_tokens_equal") else
                 "greedy tokens differ" + (f" from #{div}" if div is not None else ""))
    return ", ".join(parts)


def table(doc: dict) -> str:
    h, results = doc["header"], doc["engines"]
    batches = h["batches"]
    w = max([21] + [len(n) + 1 for n in results])      # (X@tpN names may be longer)
    lines = [f"e2e_vllm: {h.get('device')}, vLLM {h.get('vllm')}, torch {h.get('torch')}, "
             f"{model_name(h['model'])}, compile={h['compile']}",
             f"{'config':<{w}}{'start s':>8}{'wt GiB':>8}{'KV tok':>9} | ms per output token at "
             f"batch " + "/".join(map(str, batches)) + " | prefill ms | dlogprob vs "
             f"{logprob_reference(h['model'])} "
             f"(greedy mean/max; p: the prompt's)"]
    lp = doc.get("logprobs", {})
    for name, r in results.items():
        per = {d["batch"]: d.get("per_token_ms") for d in r.get("decode", [])}
        cells = " ".join(f"{per[b]:6.2f}" if per.get(b) else f"{'-':>6}" for b in batches)
        c = lp.get(name, {})
        lps = (f"{c['greedy_abs_dlogprob_mean']:.3f}/{c['greedy_abs_dlogprob_max']:.3f}"
               if c.get("greedy_abs_dlogprob_mean") is not None else
               f"p {c['prompt_abs_dlogprob_mean']:.3f}/{c['prompt_abs_dlogprob_max']:.3f}"
               if c.get("prompt_abs_dlogprob_mean") is not None else "-")
        kv = r.get("kv_cache_tokens")
        pf = r.get("prefill", {}).get("best_s")
        pfs = f"{pf * 1e3:10.1f}" if pf else f"{'-':>10}"
        lines.append(f"{name:<{w}}{r.get('start_s', float('nan')):>8.1f}"
                     f"{r.get('weight_gib', float('nan')):>8.2f}"
                     f"{kv if kv is not None else '-':>9} | {cells} | {pfs} | {lps}")
        if r.get("errors"):
            lines.append(f"{'':<{w}}errors: {'; '.join(r['errors'])[:300]}")
    for k, v in doc.get("targets", {}).items():
        lines.append(f"target {k}: {v}")
    for key, (_, what) in VARIANTS.items():
        if doc.get(key):
            lines.append(f"fp8_blockgemm {what}: {lp_words(doc[key])}")
    for name, c in doc.get("parallel_vs_tp1", {}).items():
        lines.append(f"{name} vs TP1 {parallel(name)[0]}: {lp_words(c)}")
    if h.get("skipped"):
        lines.append(f"skipped: {h['skipped']}")
    return "\n".join(lines)


def _per_token(results: dict, name: str) -> dict:
    """{batch: ms per output token} of engine `name` (empty if it did not run)."""
    return {d["batch"]: d["per_token_ms"] for d in results.get(name, {}).get("decode", [])
            if d.get("per_token_ms")}


# fp8_blockgemm's speedup over the best vLLM fp8 that each decode batch needs: issue 6 for the
# dense models, issue 42 for the MoE one (whose prefill needs PREFILL_TARGET_MOE too)
DECODE_TARGETS = {False: {1: 1.15, 4: 1.15, 16: 1.15, 64: 1.15},
                  True: {1: 1.25, 4: 1.25, 16: 1.10, 64: 1.10}}
PREFILL_TARGET_MOE = 1.10


def _need_label(need: dict) -> str:
    """'1.15x', or per batch: '1.25x at b1/b4, 1.10x at b16/b64'."""
    by = {}
    for b, v in sorted(need.items()):
        by.setdefault(v, []).append(f"b{b}")
    if len(by) == 1:
        return f"{next(iter(by)):.2f}x"
    return ", ".join(f"{v:.2f}x at {'/'.join(bs)}" for v, bs in by.items())


def targets(results: dict, batches, model: dict) -> dict:
    """The decode targets (DECODE_TARGETS of the model; the MoE model's prefill too). TP1
    engines against TP1 anchors only; fp8_blockgemm@tpN / @epN against the anchors of the
    same suffix, or without one its times alone."""
    moe = is_moe(model)
    need = DECODE_TARGETS[moe]
    out = {}

    def anchors(names):
        # the engines of `names` that ran (an anchor kept under another setting by --merge,
        # e.g. fp8_cutlass_seqs256, counts)
        return [n for n in results if n in names or re.fullmatch(
            "(?:" + "|".join(map(re.escape, names)) + r")_seqs\d+", n)]

    def best(names):
        fp8 = {}
        for n in anchors(names):
            for b, ms in _per_token(results, n).items():
                fp8[b] = min(fp8.get(b, 1e9), ms)
        return fp8

    suffixes = [""] + sorted({n[len("fp8_blockgemm"):] for n in results
                              if n.startswith("fp8_blockgemm@")})
    for sfx in suffixes:
        us = "fp8_blockgemm" + sfx
        ours = _per_token(results, us)
        n_before = len(out)
        for label, names in (("best vLLM fp8", ("fp8_cutlass", "fp8_deepgemm")),
                             ("best vLLM fp8 with Inductor PDL too",
                              ("fp8_cutlass_pdl", "fp8_deepgemm_pdl"))):
            fp8 = best([n + sfx for n in names])
            parts = []
            for b in batches:
                if b in need and b in ours and b in fp8:
                    sp = fp8[b] / ours[b]
                    parts.append(f"b{b} {sp:.2f}x {'PASS' if sp >= need[b] else 'FAIL'}")
            if parts:
                out[f"{us} vs {label}{sfx} (need >= {_need_label(need)})"] = ", ".join(parts)
            mine_pf = results.get(us, {}).get("prefill", {}).get("best_s")
            pf = [results[n]["prefill"]["best_s"] for n in anchors([m + sfx for m in names])
                  if results[n].get("prefill", {}).get("best_s")]
            if moe and mine_pf and pf:
                sp = min(pf) / mine_pf
                out[f"{us} prefill vs {label}{sfx} (need >= {PREFILL_TARGET_MOE:.2f}x)"] = (
                    f"{sp:.2f}x {'PASS' if sp >= PREFILL_TARGET_MOE else 'FAIL'}")
        bf = _per_token(results, "bf16" + sfx)
        # (fp8_blockgemm_*: the same engine with other settings, e.g. --b256's max_num_seqs
        # 256 kept beside the batch 1-64 run by --merge)
        for name in [us] + (sorted(n for n in results if n.startswith("fp8_blockgemm_seqs"))
                            if not sfx else []):
            mine = _per_token(results, name)
            parts = [f"b{b} {bf[b] / mine[b]:.2f}x" for b in batches if b in mine and b in bf]
            if parts:
                out[f"{name} speedup vs bf16{sfx}"] = ", ".join(parts)
            if 256 in mine and 256 in bf:
                out[f"{name} faster than bf16{sfx} at batch 256"] = (
                    f"{mine[256]:.2f} vs {bf[256]:.2f} ms "
                    f"{'PASS' if mine[256] < bf[256] else 'FAIL'}")
        if sfx and ours and len(out) == n_before:
            out[f"{us} ms per output token (no {sfx} anchor)"] = ", ".join(
                f"b{b} {ours[b]:.2f}" for b in batches if b in ours)
    if results.get("fp8_blockgemm", {}).get("start_s") and results.get("bf16", {}).get("start_s"):
        dt = results["fp8_blockgemm"]["start_s"] - results["bf16"]["start_s"]
        out["engine start vs bf16 (need <= +30 s)"] = (f"{dt:+.1f} s "
                                                       f"{'PASS' if dt <= 30 else 'FAIL'}")
    return out


def plot(doc: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    style = {"bf16": ("tab:gray", "x"), "fp8_blockgemm": ("tab:red", "o"),
             "fp8_cutlass": ("tab:green", "v"), "fp8_deepgemm": ("tab:blue", "D"),
             "fp8_blockgemm_online": ("tab:orange", "s"),
             "fp8_blockgemm_nopdl": ("tab:pink", "o"), "fp8_cutlass_pdl": ("tab:olive", "v"),
             "fp8_blockgemm_nofuse": ("tab:brown", "o"),
             "fp8_deepgemm_pdl": ("tab:cyan", "D")}
    h, res = doc["header"], doc["engines"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    for name, r in res.items():
        ds = [d for d in r.get("decode", []) if d.get("per_token_ms")]
        if ds:
            base, tp, ep = parallel(name)
            c, m = style.get(base, (None, "."))
            # X@tpN / X@epN: X's colour, dashed / dotted
            ax.plot([d["batch"] for d in ds], [d["per_token_ms"] for d in ds], marker=m,
                    color=c, ls=":" if ep else "--" if tp > 1 else "-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(h["batches"], [str(b) for b in h["batches"]])
    ax.set_xlabel("batch (concurrent sequences)")
    ax.set_ylabel("ms per output token (decode)")
    ax.set_title(f"vLLM {h.get('vllm')}, {model_name(h['model'])}, "
                 f"prompt {h['prompt_len']}, {h['out_len']} new tokens", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax = axes[1]
    names = [n for n in res if res[n].get("start_s") is not None]
    if names:
        xs = range(len(names))
        ax.bar([i - 0.2 for i in xs], [res[n].get("start_s", 0) for n in names], 0.4,
               label="engine start (s)")
        ax2 = ax.twinx()
        ax2.bar([i + 0.2 for i in xs], [res[n].get("weight_gib", 0) or 0 for n in names], 0.4,
                color="tab:purple", label="weights (GiB)")
        ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
        ax.set_ylabel("engine start, s")
        ax2.set_ylabel("weight memory, GiB")
        ax.legend(loc="lower left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{h.get('device')}, torch {h.get('torch')}, {h.get('date')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
