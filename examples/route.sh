#!/usr/bin/env bash
# FusionRoute on the embedded default model: make two domain experts, train the router, generate,
# evaluate, and run the baseline families. Small sizes so it finishes on a CPU; scale the numbers up
# (--train 2000 --test 200, more steps) for the protocol.
set -euo pipefail
export HF_HUB_OFFLINE=1
W=${1:-runs/route-example}
mkdir -p "$W"

llmtool route data "$W/data" --domains math,reverse --train 64 --test 16 --overwrite
llmtool route make-experts smollm2-135m "$W/experts" --data "$W/data/train.jsonl" \
    --max-steps 8 --batch-size 8 --lr 2e-4 --template raw --overwrite
E="$W/experts/math,$W/experts/reverse"

# stage 1 (routing + LM loss), then stage 2 (mixed SFT/routing + CDPO) from verifier-labelled samples
llmtool route train "$W/fr" --stage sft --experts "$E" --base smollm2-135m --data "$W/data/train.jsonl" \
    --max-steps 8 --batch-size 8 --template raw --overwrite
llmtool route make-prefs --router "$W/fr" --data "$W/data/train.jsonl" -o "$W/prefs.jsonl" --limit 16 \
    --max-new-tokens 8 --overwrite || echo "no preference pairs (every sample correct); skipping cdpo"
if [ -s "$W/prefs.jsonl" ]; then
  llmtool route train "$W/fr-cdpo" --stage cdpo --init "$W/fr" --data "$W/prefs.jsonl" --max-steps 4 \
      --batch-size 4 --lr 1e-5 --overwrite
fi

# generation with a per-token route trace, in every mode
llmtool route generate --router "$W/fr" --in "$W/data/test.jsonl" -o "$W/fusion.jsonl" --mode fusion \
    --max-new-tokens 8 --template raw --overwrite
llmtool route eval --router "$W/fr" --data "$W/data/test.jsonl" -o "$W/eval-fusion.json" --mode fusion \
    --max-new-tokens 8 --template raw --overwrite
llmtool route eval --router "$W/fr" --data "$W/data/test.jsonl" -o "$W/eval-route-only.json" --mode route-only \
    --max-new-tokens 8 --template raw --overwrite
llmtool route eval --model "$W/experts/math" --data "$W/data/test.jsonl" -o "$W/eval-expert0.json" \
    --max-new-tokens 8 --template raw --overwrite

# baselines: sequence selection, Collab-style token selection, merges, SFT on the union
llmtool route baseline "$W/seq" --method seq-select --scorer judge --experts "$E" --in "$W/data/test.jsonl" \
    --max-new-tokens 8 --template raw --overwrite
llmtool route baseline "$W/tok" --method token-select --experts "$E" --in "$W/data/test.jsonl" \
    --max-new-tokens 8 --template raw --overwrite
llmtool route baseline "$W/ta" --method merge-ta --experts "$E" --lam 1.0 --overwrite
llmtool route baseline "$W/dare" --method merge-dare --experts "$E" --drop 0.5 --overwrite
llmtool route eval --model "$W/ta" --data "$W/data/test.jsonl" -o "$W/eval-ta.json" --max-new-tokens 8 \
    --template raw --overwrite
