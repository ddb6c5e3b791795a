#!/usr/bin/env bash
# LLM-PV on the embedded default model: generate a task, propose programs, verify them in the sandbox,
# select by validation accuracy; then a classical baseline on the same split and a replayed correct
# program (what a strong proposer gives). Point --proposer at openai:MODEL --api-base URL (e.g. a vLLM
# server) for a model that can actually write these programs.
set -euo pipefail
export HF_HUB_OFFLINE=1
W=${1:-runs/learn-program-example}
mkdir -p "$W"

llmtool tasks list
llmtool tasks generate "$W/parity20" --task parity_all --length 20 --train 100 --val 100 --test 1000 --overwrite

# propose-and-verify with the local 135M model (k = 8 here; the paper uses k up to 64+)
llmtool learn-program run "$W/run-hf" --proposer hf:smollm2-135m --data "$W/parity20" \
    --samples 8 --max-new-tokens 192 --test-lengths 20,100 --overwrite
cat "$W/run-hf/summary.json"

# the same split for XGBoost (fits the training set, stays near chance on parity)
llmtool learn-program baseline "$W/xgb" --method xgboost --data "$W/parity20" --overwrite

# a replay proposer: one JSON object per line, {"raw_text": "<model answer with a ```python block>"}
cat > "$W/replay.jsonl" <<'JSONL'
{"raw_text": "```python\ndef f(x):\n    return int(x[0] == '1')\n```"}
{"raw_text": "```python\ndef f(x):\n    return x.count('1') % 2\n```"}
JSONL
llmtool learn-program run "$W/run-replay" --proposer "replay:$W/replay.jsonl" --data "$W/parity20" \
    --samples 2 --no-early-stop --test-lengths 100 --overwrite
cat "$W/run-replay/selected.py"
