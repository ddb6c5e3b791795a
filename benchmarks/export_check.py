"""Load check of llmtool's output formats (issue 18): each output is refused by plain transformers, and
`llmtool models export` writes a checkpoint other tools load whose perplexity matches `llmtool.load`'s.

For each setting the default model is compressed or quantized by the CLI (its own subprocess), then:
1. ``AutoModelForCausalLM.from_pretrained(OUT)`` is tried (before this change it built a Llama with random
   projections: perplexity 3.3e11); the first line of its error is recorded;
2. ``llmtool models export OUT EXPORT --format dense|compressed-tensors`` runs (a subprocess; seconds and
   disk size recorded, and the size relative to the fp32 source);
3. perplexity on the first --eval-tokens tokens of austen-test (disjoint windows of --seqlen) of
   ``llmtool.load(OUT)`` and of the model transformers loads from EXPORT (for compressed-tensors: through
   its CompressedTensorsHfQuantizer, with the packed weights and, at W8A8, compressed-tensors' own dynamic
   activation quantizer).
For W4A4 the dense export is the weight-only model (activation quantization has no plain form), so its
perplexity is expected to differ from the W4A4 model's; W8A8 through compressed-tensors has the same weights
but its own arithmetic for the dynamic activation quantizer (asymmetric: the zero point is added before
rounding, which flips about 1 code in 4e5; symmetric: max|x|/127.5 where llmtool divides by 127), so only
close perplexities are expected; the table says which rows must match.

    python benchmarks/export_check.py [--eval-tokens 4096] [--threads 2] [--only NAME ...]

``--only`` reruns the settings whose names contain one of the words and keeps the other rows of the
previous results. Writes benchmarks/results/export_check.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RTN = ["quantize", "--method", "rtn", "{model}", "{out}", "--no-eval"]
SETTINGS = {
    # name: (argv after `llmtool`, with {model} and {out}; whether the export must match exactly; export format)
    "compress svd-llm 0.2": (["compress", "--method", "svd-llm", "{model}", "{out}", "--ratio", "0.2",
                              "--calib-samples", "8", "--calib-seqlen", "256"], True, "dense"),
    "quantize rtn W4A16": ([*RTN, "--w-bits", "4", "--a-bits", "16"], True, "dense"),
    "quantize quarot W4A16 (GPTQ)": (["quantize", "--method", "quarot", "{model}", "{out}", "--w-bits", "4",
                                      "--a-bits", "16", "--no-eval", "--calib-samples", "16"], True, "dense"),
    "quantize quarot W4A4 (GPTQ)": (["quantize", "--method", "quarot", "{model}", "{out}", "--w-bits", "4",
                                     "--a-bits", "4", "--no-eval", "--calib-samples", "16"], False, "dense"),
    # compressed-tensors (per-channel symmetric weights: llmtool has no group-wise scales)
    "ct rtn W4A16": ([*RTN, "--w-bits", "4", "--a-bits", "16"], True, "compressed-tensors"),
    "ct rtn W8A16": ([*RTN, "--w-bits", "8", "--a-bits", "16"], True, "compressed-tensors"),
    # W8A8: same activation quantizer formula, but compressed-tensors adds the zero point before rounding
    # (x/s + z in float32), which flips ~1 in 4e5 codes near a rounding boundary; the flips compound
    "ct rtn W8A8 (asym act)": ([*RTN, "--w-bits", "8", "--a-bits", "8"], False, "compressed-tensors"),
    "ct rtn W8A8 (sym act)": ([*RTN, "--w-bits", "8", "--a-bits", "8", "--a-sym"], False, "compressed-tensors"),
    "ct gptq W4A16": ([*RTN, "--weight-algorithm", "gptq", "--w-bits", "4", "--a-bits", "16",
                       "--calib-samples", "16"], True, "compressed-tensors"),
}


def _cli(*argv) -> float:
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "llmtool", "--quiet", *argv], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"llmtool {' '.join(argv)} failed: {p.stderr.strip()[-500:]}")
    return time.time() - t0


def _size_mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**20


COLUMNS = ("setting", "format", "refused_by_plain", "ppl_llmtool", "ppl_export", "rel_diff", "must_match", "match",
           "llmtool_mb", "export_mb", "export_vs_fp32", "export_seconds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    import llmtool
    from llmtool.core import data as data_mod
    from llmtool.core.console import markdown_table
    from llmtool.core.evalkit import perplexity
    from llmtool.core.models import load_tokenizer, resolve_model

    torch.set_num_threads(a.threads)
    src = resolve_model(a.model)
    ids = data_mod.tokenize(load_tokenizer(src), data_mod.load_text("austen-test"))

    def ppl(m) -> float:
        return perplexity(m, ids, seqlen=a.seqlen, max_tokens=a.eval_tokens).ppl

    dst = ROOT / "benchmarks" / "results" / "export_check"
    previous = {}
    if a.only and dst.with_suffix(".json").is_file():
        old = json.loads(dst.with_suffix(".json").read_text())
        if old.get("model") == a.model and old.get("eval", {}).get("tokens") == a.eval_tokens:
            previous = {r["setting"]: r for r in old["rows"]}
    src_mb = _size_mb(src)
    rows = [{"setting": "source model (fp32)", "format": "transformers", "refused_by_plain": None,
             "ppl_llmtool": ppl(llmtool.load(src)), "ppl_export": None, "must_match": None, "match": None,
             "llmtool_mb": round(src_mb, 1)}]
    with tempfile.TemporaryDirectory(prefix="export-check-") as tmp:
        for name, (argv, must_match, fmt_name) in SETTINGS.items():
            if a.only and not any(o in name for o in a.only):
                if name in previous:  # kept measurements, labels from the current SETTINGS
                    r = dict(previous[name], format=fmt_name, must_match=must_match)
                    r["match"] = r["rel_diff"] < 1e-4 if must_match and r.get("rel_diff") is not None else None
                    if r.get("export_mb") is not None:
                        r["export_vs_fp32"] = round(r["export_mb"] / src_mb, 3)
                    rows.append(r)
                continue
            out, exported = Path(tmp) / f"o{len(rows)}", Path(tmp) / f"e{len(rows)}"
            run_s = _cli("--threads", str(a.threads), *[x.format(model=src, out=out) for x in argv])
            try:
                AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
                refused = "LOADED (garbage)"
            except (ValueError, OSError, KeyError) as e:
                refused = str(e).splitlines()[0][:120]
            export_s = _cli("models", "export", str(out), str(exported), "--format", fmt_name)
            p_ours = ppl(llmtool.load(out))
            p_plain = ppl(AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval())
            rel = abs(p_plain - p_ours) / p_ours
            rows.append({"setting": name, "format": fmt_name, "refused_by_plain": refused, "ppl_llmtool": p_ours,
                         "ppl_export": p_plain, "rel_diff": rel, "must_match": must_match,
                         "match": rel < 1e-4 if must_match else None, "run_seconds": round(run_s, 1),
                         "export_seconds": round(export_s, 1), "llmtool_mb": round(_size_mb(out), 1),
                         "export_mb": round(_size_mb(exported), 1),
                         "export_vs_fp32": round(_size_mb(exported) / src_mb, 3)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    import transformers

    try:
        import compressed_tensors
        ct = f", compressed-tensors {compressed_tensors.__version__}"
    except ImportError:
        ct = ""
    res = {"command": "python benchmarks/export_check.py " + shlex.join(sys.argv[1:]), "model": a.model,
           "eval": {"data": "austen-test", "tokens": a.eval_tokens, "seqlen": a.seqlen}, "rows": rows,
           "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, transformers {transformers.__version__}{ct}"}
    dst.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    def fmt(v) -> str:
        return "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    table = markdown_table([{k: fmt(r.get(k)) for k in COLUMNS} for r in rows])
    dst.with_suffix(".md").write_text(
        f"# Export / load check ({a.model})\n\nCommand: `{res['command']}` ({res['machine']})"
        + (" — rows of settings not matched by --only are kept from the previous results" if a.only else "")
        + "\n\n"
        f"Perplexity on the first {a.eval_tokens} tokens of austen-test (windows of {a.seqlen}). "
        "`refused_by_plain`: the first line of `AutoModelForCausalLM.from_pretrained(OUT)`'s error. `ppl_export`: "
        "the model transformers loads from `llmtool models export OUT EXPORT --format FORMAT` (compressed-tensors: "
        "through its CompressedTensorsHfQuantizer). `must_match`: the export is the same model (weight-only "
        "settings); W4A4's dense export is its weight-only model. W8A8 through compressed-tensors: the weights "
        "are the same, the dynamic per-token activation quantizer differs in arithmetic only (asymmetric: the "
        "same scale and zero point, but x/s + z is rounded after adding z in float32, flipping about 1 code in "
        "4e5; symmetric: max|x|/127.5 where llmtool and vLLM use 127), and the flips compound through the layers. "
        "Sizes: safetensors "
        "MB; `export_vs_fp32`: export size / fp32 source size. Per-channel symmetric weight scales throughout "
        "(llmtool has no group-wise scales).\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
