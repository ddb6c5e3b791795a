#!/usr/bin/env bash
# `llmtool quantize` on the packaged default model: ReSpinQuant W4A4 and its baselines, then reload.
set -euo pipefail
OUT=${OUT:-runs/quantize}
mkdir -p "$OUT"
# ReSpinQuant W4A4 (learned layer-wise rotations, rank-32 residual transitions, GPTQ weights)
llmtool quantize --method respinquant smollm2-135m "$OUT/respinquant-w4a4" --w-bits 4 --a-bits 4 --kv-bits 16 \
    --rank 32 --train-steps 16 --train-seqlen 256 --calib-samples 16 --calib-seqlen 512 --overwrite
# baselines with the same bits, calibration data and seed
llmtool quantize --method quarot smollm2-135m "$OUT/quarot-w4a4" --w-bits 4 --a-bits 4 --overwrite
llmtool quantize --method rtn smollm2-135m "$OUT/rtn-w4a4" --w-bits 4 --a-bits 4 --overwrite
# W3A3 with a 4-bit KV cache
llmtool quantize --method respinquant smollm2-135m "$OUT/respinquant-w3a3kv4" --w-bits 3 --a-bits 3 --kv-bits 4 --overwrite
# the packed checkpoints reload with llmtool.load (simulated W4A4 evaluation)
llmtool evaluate ppl "$OUT/respinquant-w4a4" --max-tokens 4096
python -c "import llmtool; m = llmtool.load('$OUT/quarot-w4a4'); print(type(m).__name__)"
