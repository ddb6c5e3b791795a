#!/usr/bin/env bash
# Low-rank compression of the embedded default model with ZS-SVD and its baselines, then perplexity.
set -euo pipefail
OUT=${OUT:-/tmp/llmtool-compress-example}
mkdir -p "$OUT"
llmtool models pull smollm2-135m
llmtool compress --method zs-svd smollm2-135m "$OUT/zs-svd-0.2" --ratio 0.2 --calib-samples 8 --calib-seqlen 256 --overwrite
llmtool compress --method svd-llm smollm2-135m "$OUT/svd-llm-0.2" --ratio 0.2 --calib-samples 8 --calib-seqlen 256 --overwrite
llmtool compress --method svd smollm2-135m "$OUT/svd-0.2" --ratio 0.2 --overwrite
for m in zs-svd svd-llm svd; do
  llmtool evaluate ppl "$OUT/$m-0.2" --max-tokens 2048
done
# truncate -> correct -> re-truncate (one pull-subspace correction)
llmtool compress --method zs-svd smollm2-135m "$OUT/zs-svd-0.2-corr" --ratio 0.2 --correction pull-subspace \
  --calib-samples 8 --calib-seqlen 256 --proj-seqlen 256 --overwrite
python -c "import llmtool, sys; m = llmtool.load(sys.argv[1]); print(m.model.layers[0].self_attn.q_proj)" "$OUT/zs-svd-0.2"
