#!/usr/bin/env bash
# Watermark -> detect -> attack -> score, on the packaged default model (SmolLM2-135M-Instruct).
set -euo pipefail
W=${W:-$(mktemp -d)}
S=${SCHEME:-kgw}
llmtool evade prompts -o "$W/prompts.jsonl" --n 8 --overwrite
llmtool evade watermark smollm2-135m "$W/prompts.jsonl" -o "$W/wm.jsonl" --scheme "$S" --max-new-tokens 100 --overwrite
llmtool evade detect "$W/wm.jsonl" --scheme "$S" -o "$W/det_wm.jsonl" --overwrite
llmtool evade detect "$W/prompts.jsonl" --field human_text --scheme "$S" -o "$W/det_human.jsonl" --overwrite
for M in bira vanilla word-delete; do
  EXTRA=(); [ "$M" = word-delete ] || EXTRA=(--paraphraser smollm2-135m)   # word-delete uses no model
  llmtool evade attack "$W/wm.jsonl" -o "$W/$M.jsonl" --method "$M" ${EXTRA[@]+"${EXTRA[@]}"} --overwrite
  llmtool evade detect "$W/$M.jsonl" --field attacked_text --scheme "$S" -o "$W/det_$M.jsonl" --overwrite
  llmtool evade metrics "$W/det_$M.jsonl" "$W/det_human.jsonl"
done
llmtool evade quality "$W/bira.jsonl"
echo "outputs in $W"
