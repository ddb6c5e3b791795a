"""Benchmark of `llmtool quantize`: RTN vs QuaRot vs SpinQuant vs ReSpinQuant (r = 0, 32, D) on the
default model, at W4A4 and W3A3 (KV 16), same calibration windows, seed and evaluation text.

Writes benchmarks/results/quantize.json and benchmarks/results/quantize.md. Defaults are the
shortened CPU recipe (see docs/quantize.md); flags give bigger runs, e.g.
``--train-steps 100 --train-seqlen 2048 --calib-samples 128 --calib-seqlen 2048 --max-tokens 65536``.

The committed table was produced in two parts run side by side (W4A4 and W3A3) and merged:
``python benchmarks/quantize.py --settings 4-4 --tag quantize-w4a4``,
``python benchmarks/quantize.py --settings 3-3 --methods rtn,quarot,respinquant --ranks 32 --skip-fp --tag quantize-w3a3``,
``python benchmarks/quantize.py --merge benchmarks/results/quantize-w4a4.json benchmarks/results/quantize-w3a3.json``.

ReSpinQuant's rank ablation re-uses one set of learned rotations: the rotations are learned once per
bit setting, then fused with each rank (0, 32, D) and GPTQ-quantized separately.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calib-data", default="austen-train")
    p.add_argument("--eval-data", default="austen-test")
    p.add_argument("--calib-samples", type=int, default=4)
    p.add_argument("--calib-seqlen", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=2)
    p.add_argument("--train-seqlen", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--settings", default="4-4,3-3", help="comma list of W-A bit pairs")
    p.add_argument("--methods", default="rtn,quarot,spinquant,respinquant")
    p.add_argument("--ranks", default="0,32,D", help="ReSpinQuant ranks to fuse at the first setting (D = hidden)")
    p.add_argument("--ranks-other", default="32", help="ReSpinQuant ranks at the other settings")
    p.add_argument("--methods-other", default="rtn,quarot,respinquant", help="methods at the other settings")
    p.add_argument("--w-clip", action="store_true", help="per-channel clip search for weights (CLI default; "
                   "off here to fit the CPU time budget)")
    p.add_argument("--weight-algorithm", default="rtn", choices=["rtn", "gptq"],
                   help="weight quantizer for every method (the paper: gptq; default rtn to fit the CPU budget)")
    p.add_argument("--tag", default="quantize", help="results file stem (benchmarks/results/<tag>.json/.md)")
    p.add_argument("--merge", nargs="*", default=None,
                   help="only merge these result JSONs (in order) into benchmarks/results/quantize.json/.md")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-fp", action="store_true", help="do not evaluate the unquantized model")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    from llmtool.core.job import apply_threads

    apply_threads(args.threads)

    from llmtool.core import data as data_mod
    from llmtool.core.console import markdown_table
    from llmtool.core.evalkit import peak_rss_mb, perplexity
    from llmtool.core.models import load_model, load_tokenizer, resolve_model, set_seed
    from llmtool.quantize import register_all
    from llmtool.quantize.api import (_replace_linears, enable_activation_quant, install_low_rank_transitions,
                                      quantize_weights, round_storage)
    from llmtool.quantize.formats import quant_block, storage_tensors
    from llmtool.quantize.runner import make_config
    from llmtool.quantize import respinquant as rsq
    from llmtool.quantize import rotations as R
    from llmtool.core.checkpoint import dir_size_bytes

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cols = ["method", "bits", "ppl", "quant_s", "size_MB", "transition_err", "train_ce_first_last"]

    def write(record, name):
        (out / f"{name}.json").write_text(json.dumps(record, indent=2))
        a = record["args"]
        md = (f"# quantize benchmark\n\nModel {a['model']}, eval {a['eval_data']} first {a['max_tokens']} tokens at "
              f"seqlen {a['seqlen']}; calibration {a['calib_samples']}x{a['calib_seqlen']} of {a['calib_data']}; "
              f"rotation training {a['train_steps']} steps x 1 x {a['train_seqlen']}; KV16; weights "
              f"{a['weight_algorithm']}, clip search {'on' if a['w_clip'] else 'off'}; seed {a['seed']}. "
              f"Peak RSS {record['peak_rss_mb']:.0f} MB, total {record['total_seconds']:.0f} s.\n\n"
              f"Command(s): {'; '.join('`' + c + '`' for c in record['commands'])}\n\n"
              + markdown_table(record["rows"], cols) + "\n")
        (out / f"{name}.md").write_text(md)
        return md

    if args.merge is not None:
        recs = [json.loads(Path(f).read_text()) for f in args.merge]
        merged = {"args": recs[0]["args"], "rows": [r for rec in recs for r in rec["rows"]],
                  "total_seconds": sum(r["total_seconds"] for r in recs),
                  "peak_rss_mb": max(r["peak_rss_mb"] for r in recs),
                  "commands": [c for r in recs for c in r["commands"]], "parts": [r["args"] for r in recs]}
        print(write(merged, "quantize"))
        return
    cmd = "python benchmarks/quantize.py " + " ".join(argv if argv is not None else sys.argv[1:])
    register_all()
    set_seed(args.seed)
    src = resolve_model(args.model)
    tok = load_tokenizer(src)
    base = load_model(src)
    calib = data_mod.calibration_batches(tok, args.calib_data, args.calib_samples, args.calib_seqlen, args.seed,
                                         bos=True)
    ids = data_mod.tokenize(tok, data_mod.load_text(args.eval_data))
    bos = data_mod.scoring_bos(tok)  # Gemma's windows start with its BOS, as `evaluate ppl` and compress.py score
    hidden = base.config.hidden_size

    def ppl(m):
        # one window at a time: the same sums, and a 262k vocabulary (Gemma 3) needs 1 GB of logits per window
        return perplexity(m, ids, seqlen=args.seqlen, max_tokens=args.max_tokens, bos_token_id=bos,
                          batch_size=1).ppl

    def size_of(m, cfg, rotated, rank):
        """Bytes of the tensors the checkpoint stores (safetensors adds only a small JSON header)."""
        tensors = storage_tensors(m, quant_block(cfg, rotated, rank, m.config))
        seen, total = set(), 0
        for t in tensors.values():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    rows = []
    t0 = time.perf_counter()

    def checkpoint_rows():
        record = {"args": {**vars(args), "out": os.path.relpath(args.out, ROOT)}, "rows": rows, "total_seconds": time.perf_counter() - t0,
                  "peak_rss_mb": peak_rss_mb(), "torch_threads": torch.get_num_threads(), "commands": [cmd.strip()]}
        print(rows[-1], flush=True)
        return write(record, args.tag)

    if not args.skip_fp:
        rows.append({"method": "fp32", "bits": "W16A16", "ppl": ppl(base), "quant_s": 0.0,
                     "size_MB": dir_size_bytes(src) / 1e6})
        checkpoint_rows()
    settings = [tuple(int(b) for b in s.split("-")) for s in args.settings.split(",")]
    ranks = [hidden if r == "D" else int(r) for r in args.ranks.split(",")]
    ranks_other = [hidden if r == "D" else int(r) for r in args.ranks_other.split(",")]
    for k, (w_bits, a_bits) in enumerate(settings):
        tag = f"W{w_bits}A{a_bits}"
        ranks_here = ranks if k == 0 else ranks_other
        for method in (args.methods if k == 0 else args.methods_other).split(","):
            wanted = dict(w_bits=w_bits, a_bits=a_bits, train_steps=args.train_steps, train_seqlen=args.train_seqlen,
                          seed=args.seed, w_clip=args.w_clip, weight_algorithm=args.weight_algorithm)
            own = {f.name for f in register_all().get_config(method).fields()}
            cfg = make_config(method, **{k: v for k, v in wanted.items() if k in own})
            if method != "respinquant":
                m = copy.deepcopy(base)
                from llmtool.quantize.api import quantize_

                t = time.perf_counter()
                rep = quantize_(m, cfg, calib)
                qs = time.perf_counter() - t
                rotated = rep.get("rotations") is not None
                rows.append({"method": method, "bits": tag, "ppl": ppl(m), "quant_s": qs,
                             "size_MB": size_of(m, cfg, rotated, None) / 1e6})
                checkpoint_rows()
                del m
                continue
            # respinquant: learn once, fuse with each rank
            m0 = copy.deepcopy(base)
            t = time.perf_counter()
            R.prepare(m0)
            R.fuse_down_hadamard(m0)
            rot = rsq.build_rotations(m0, cfg, tied=False)
            losses = rsq.learn_rotations(m0, rot, calib, cfg)
            train_s = time.perf_counter() - t
            for rank in ranks_here:
                m = m0 if rank == ranks_here[-1] else copy.deepcopy(m0)   # the last rank fuses m0 itself
                t = time.perf_counter()
                R.fuse(m, rot)
                terr = install_low_rank_transitions(m, rot, rank)
                _replace_linears(m, cfg, True)
                quantize_weights(m, cfg, calib)
                enable_activation_quant(m, cfg)
                round_storage(m, cfg)
                qs = train_s + time.perf_counter() - t
                rows.append({"method": f"respinquant r={rank}", "bits": tag, "ppl": ppl(m), "quant_s": qs,
                             "size_MB": size_of(m, cfg, True, rank) / 1e6,
                             "transition_err": terr["transition_error_mean"],
                             "train_ce_first_last": f"{losses[0]:.3f}->{losses[-1]:.3f}"})
                checkpoint_rows()
                del m
            del m0
    print(checkpoint_rows())


if __name__ == "__main__":
    main()
