#!/usr/bin/env bash
# llmtool edit on the packaged default model (CPU; each edit takes a few minutes on 2 cores).
set -euo pipefail
OUT=${OUT:-/tmp/llmtool-edit-example}
rm -rf "$OUT" && mkdir -p "$OUT"
# MEMIT with the paper's forward anchor, first 2 packaged counterfactual requests
llmtool edit --method memit --anchor forward --limit 2 smollm2-135m counterfact-smollm2 "$OUT/memit-fe"
llmtool evaluate edits "$OUT/memit-fe" counterfact-smollm2 --limit 2 --fluency-prompts 2 --fluency-tokens 30
# keystone neurons: find, ablate vs matched random sets, keystone-only SFT on a synthetic task
llmtool edit keystone find smollm2-135m --out "$OUT/keystone.json"
llmtool edit keystone ablate smollm2-135m --neurons "$OUT/keystone.json" --k 1,10,30
llmtool edit keystone finetune smollm2-135m "$OUT/sft-keystone" --neurons "$OUT/keystone.json" --k 30 --max-steps 20
