"""Low-bit inference on the CPU (issue 18): in-memory size and decode speed of quantized models as ratios
to the fp32 model, and their perplexity.

For each setting the default model (SmolLM2-135M-Instruct, fp32) is quantized in memory with
``llmtool.quantize.quantize_`` (RTN weights with the clip search, per-channel; no calibration), then:
* memory: bytes of parameters + buffers + the kernel caches built on the first forward
  (``QuantLinear.cache_bytes``: int4/int8 packed operands; no float copy of any weight);
* decode: greedy generation of --new-tokens tokens after a 32-token prompt, batch 1, KV cache on,
  --repeats runs interleaved with the fp32 model (A B A B ...) so both see the same machine load; median
  tokens/s and the ratio of medians;
* perplexity on the first --eval-tokens tokens of austen-test (windows of 512).
Paths (llmtool.quantize.modules.QuantLinear): int8 weight codes cached, widened per call (weight-only:
dequantized transiently; W4A4: integer sums in float32); with --dtype bfloat16, W4A16 goes through torch's
``_weight_int4pack_mm_for_cpu``. Embeddings and lm_head stay fp32 (rounded through fp16) in every setting.
Measured on the AVX2 CPU of this project's machine, M = 1 decode row, one thread, 1536 x 576 layer:
fp32 GEMM 0.8 ms; int4 kernel 16 ms with float32 activations, 1.1 ms with bfloat16; ``_weight_int8pack_mm``
8.5 ms; ``torch._int_mm`` 6.6-8 ms (3.2 s at M = 512); dequantizing from int8 codes + fp32 GEMM 3 ms;
the previous path (unpacking nibbles every call) 74 ms.

    python benchmarks/quantize_inference.py [--threads 2] [--new-tokens 64] [--repeats 5]

Writes benchmarks/results/quantize_inference.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {"fp32": None, "rtn W4A16": {"w_bits": 4, "a_bits": 16}, "rtn W8A16": {"w_bits": 8, "a_bits": 16},
            "rtn W4A4": {"w_bits": 4, "a_bits": 4}}


@torch.no_grad()
def decode_tps(model, prompt, new_tokens: int) -> float:
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return new_tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from llmtool.core.console import markdown_table
    from llmtool.core.data import load_text
    from llmtool.core.lm import token_nll
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.quantize.api import quantize_
    from llmtool.quantize.modules import resident_bytes
    from llmtool.quantize.runner import make_config

    tok = load_tokenizer(args.model)
    ids = tok(load_text("austen-test"), return_tensors="pt")["input_ids"][0][: args.eval_tokens]
    windows = ids[: len(ids) // 512 * 512].reshape(-1, 512)
    prompt = ids[None, :32]

    def ppl(model) -> float:
        nll = torch.cat([token_nll(model, w[None]).reshape(-1) for w in windows])
        return float(torch.exp(nll.mean()))

    base = load_model(args.model, dtype="float32")
    models = {"fp32": base}
    for name, kw in SETTINGS.items():
        if kw is not None:
            m = load_model(args.model, dtype="float32")
            quantize_(m, make_config("rtn", **kw), None)
            models[name] = m
    for m in models.values():          # build the kernel caches before measuring memory and speed
        m(input_ids=prompt)
    speeds = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, m in models.items():
            speeds[name].append(decode_tps(m, prompt, args.new_tokens))
    fp_bytes, fp_tps = resident_bytes(base), statistics.median(speeds["fp32"])
    rows = []
    for name, m in models.items():
        tps = statistics.median(speeds[name])
        rows.append({"setting": name, "memory_mb": round(resident_bytes(m) / 2 ** 20, 1),
                     "memory_ratio": round(resident_bytes(m) / fp_bytes, 3), "decode_tok_s": round(tps, 1),
                     "decode_ratio": round(tps / fp_tps, 2),
                     "decode_tok_s_runs": [round(s, 1) for s in speeds[name]], "ppl": round(ppl(m), 2)})
        print(rows[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"settings": vars(args), "torch": torch.__version__, "rows": rows}
    (RESULTS / "quantize_inference.json").write_text(json.dumps(doc, indent=2))
    cols = ["setting", "memory_mb", "memory_ratio", "decode_tok_s", "decode_ratio", "ppl"]
    md = ["# Low-bit inference on the CPU", "",
          f"Command: `python benchmarks/quantize_inference.py --threads {args.threads} --new-tokens {args.new_tokens} "
          f"--repeats {args.repeats}` ({args.model}, torch {torch.__version__}; greedy decode, batch 1, median of "
          f"{args.repeats} interleaved runs; perplexity on {len(windows) * 512} austen-test tokens).", "",
          markdown_table(rows, cols), ""]
    (RESULTS / "quantize_inference.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
