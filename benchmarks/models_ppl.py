"""Perplexity of the three packaged real models on the same Austen test text (benchmarks/results/models_ppl.*).

Models: smollm2-135m (Llama), gemma3-270m (Gemma 3), qwen2.5-coder-0.5b (Qwen2), each materialized with
`llmtool models pull ALIAS` (float32 dequantized from their 4-bit GGUFs: the numbers are those of the
quantized models, not of the hub's bf16 weights).

Text: the first --chars characters of `austen-test` (Northanger Abbey, held out from every calibration
set), written to one file so every model reads exactly the same characters. The tokenizers differ
(vocabularies of 49k, 151k and 262k tokens), so per-token perplexities are not comparable across models;
**bits per byte** is: total NLL (nats) / ln 2 / UTF-8 bytes of the text.

Two protocols, both on disjoint windows of --seqlen tokens:
* ``cli``: `llmtool --json evaluate ppl MODEL --data TEXT --seqlen S --max-tokens 1048576` run as a subprocess,
  exactly as a user would. For a tokenizer that adds no BOS (SmolLM2, Qwen2.5) the first token of each window
  is context only, so bits per byte is estimated as mean NLL x (scored + windows) tokens (every token's mean
  cost); for one that adds a BOS (Gemma) `evaluate ppl` starts each window with it and scores every token
  (its output says `"bos": true`), so bits per byte is exact.
* ``bos``: each window is the tokenizer's BOS followed by S-1 text tokens and every text token is scored
  (the first one given BOS alone), for models whose tokenizer adds a BOS to plain text (Gemma's does; a
  Gemma model without its `<bos>` attention sink is far worse: see the table). Exact bits per byte.
    python benchmarks/models_ppl.py                       # 12k characters: minutes per model on 2 free cores
    python benchmarks/models_ppl.py --chars 100000 --models gemma3-270m
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from llmtool.core.console import markdown_table  # noqa: E402

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]


def cli_ppl(alias: str, text_file: Path, seqlen: int, threads: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "llmtool", "--json", "--threads", str(threads), "evaluate", "ppl", alias,
                        "--data", str(text_file), "--seqlen", str(seqlen), "--max-tokens", "1048576",
                        "--batch-size", "1"], capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"evaluate ppl {alias} failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    r = json.loads(p.stdout)
    r["data"] = f"austen-test prefix ({text_file.name})"  # the temp file's path is machine-local
    r["seconds"] = round(time.perf_counter() - t0, 1)
    return r


def bos_ppl(alias: str, text: str, seqlen: int, threads: int) -> dict | None:
    import torch

    from llmtool.core import data as data_mod
    from llmtool.core.models import load_model, load_tokenizer

    torch.set_num_threads(threads)
    tok = load_tokenizer(alias)
    bos = tok.bos_token_id
    if bos is None or tok("a")["input_ids"][:1] != [bos]:
        return None  # this tokenizer adds no BOS to plain text: the cli protocol is the model's own
    t0 = time.perf_counter()
    model = load_model(alias)
    ids = data_mod.tokenize(tok, text)
    total, n, windows = 0.0, 0, 0
    with torch.no_grad():
        for b in range(0, ids.numel(), seqlen - 1):
            x = torch.cat([torch.tensor([bos]), ids[b:b + seqlen - 1]])[None]
            logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)
            total += -logp.gather(-1, x[0, 1:, None]).sum().item()
            n += x.shape[1] - 1
            windows += 1
    return {"nll": total / n, "ppl": math.exp(total / n), "tokens": n, "windows": windows, "total_nll": total,
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--chars", type=int, default=12000, help="First N characters of austen-test.")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-bos", action="store_true", help="Only the cli protocol.")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "models_ppl")
    a = p.parse_args()

    from llmtool.core import data as data_mod
    from llmtool.core import defaults

    text = data_mod.load_text("austen-test")[: a.chars]
    nbytes = len(text.encode("utf-8"))
    rows, runs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "austen-test-prefix.txt"
        text_file.write_text(text, encoding="utf-8")
        for alias in a.models:
            spec = defaults.MODELS[alias]
            r = cli_ppl(alias, text_file, a.seqlen, a.threads)
            # without a BOS the first token of every window is context only; with one every token is scored
            n_text = r["tokens"] if r.get("bos") else r["tokens"] + r["windows"]
            bpb = r["nll"] * n_text / math.log(2) / nbytes
            runs[alias] = {"cli": r}
            rows.append({"model": alias, "family": spec.expect[0] if spec.expect else "", "protocol": "cli",
                         "text tokens": n_text, "bytes/token": round(nbytes / n_text, 2), "ppl": round(r["ppl"], 2),
                         "bits/byte": round(bpb, 4), "s": r["seconds"]})
            print(json.dumps(rows[-1]), flush=True)
            if not a.no_bos:
                rb = bos_ppl(alias, text, a.seqlen, a.threads)
                runs[alias]["bos"] = rb
                if rb is not None:
                    rows.append({"model": alias, "family": rows[-1]["family"], "protocol": "bos",
                                 "text tokens": rb["tokens"], "bytes/token": round(nbytes / rb["tokens"], 2),
                                 "ppl": round(rb["ppl"], 2),
                                 "bits/byte": round(rb["total_nll"] / math.log(2) / nbytes, 4), "s": rb["seconds"]})
                    print(json.dumps(rows[-1]), flush=True)
            write(a, rows, runs, nbytes)  # after every model: a partial run leaves its rows


def write(a, rows: list[dict], runs: dict, nbytes: int) -> None:
    meta = {"data": "austen-test", "chars": a.chars, "bytes": nbytes, "seqlen": a.seqlen, "threads": a.threads,
            "command": "python benchmarks/models_ppl.py " + " ".join(sys.argv[1:]),
            "models_requested": a.models, "models_done": list(runs),
            "weights": "float32 dequantized from the packaged 4-bit GGUFs (Q4_1 SmolLM2, Q4_K_M Gemma 3 and Qwen2.5)"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2))
    md = [f"# Packaged models: perplexity on the first {a.chars:,} characters of austen-test", "",
          f"`{meta['command']}`; disjoint windows of {a.seqlen} tokens; {meta['weights']}.", "",
          "Per-token perplexity depends on the tokenizer; bits per byte compares the models. `cli` = "
          "`llmtool evaluate ppl` (a BOS first in each window only where the tokenizer adds one: Gemma); `bos` = each window starts with the tokenizer's BOS.", "",
          markdown_table(rows), ""]
    if len(runs) < len(a.models):
        md.append(f"Partial run: {len(runs)} of {len(a.models)} models ({', '.join(a.models[len(runs):])} not yet).\n")
    a.out.with_suffix(".md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
