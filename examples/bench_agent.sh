#!/usr/bin/env bash
# bench-agent: PIPE interface rewrites + Interface Reliance on the built-in environments, and the
# UltraHorizon rule-discovery environments. The scripted oracle runs in seconds; the default model
# part is small so it finishes on a CPU (scale --episodes up, or point MODEL at a vLLM server).
set -euo pipefail
export HF_HUB_OFFLINE=1
W=${1:-runs/bench-agent-example}
MODEL=${MODEL:-hf:smollm2-135m}          # or openai:http://127.0.0.1:8000/v1#Qwen/Qwen2.5-7B-Instruct
mkdir -p "$W"

llmtool bench-agent envs
llmtool bench-agent rewrite-spec --env grid-nav            # shows the aliases and validates the spec

# the scripted oracle under every rewrite (must be 100 %), then SR drops and IR from the dual pair
for mode in none synonym obfuscate dual-ori-first dual-syn-first; do
  llmtool bench-agent run script:oracle "$W/oracle/grid-nav/$mode" --env grid-nav --rewrite "$mode" \
      --episodes 50 --concurrency 4 --overwrite -q
done
llmtool bench-agent report "$W/oracle" -o "$W/oracle-report.md"

# a model (in-process or behind an OpenAI-compatible server), same tasks, same seeds
for mode in none synonym obfuscate dual-ori-first dual-syn-first; do
  llmtool bench-agent run "$MODEL" "$W/model/grid-nav/$mode" --env grid-nav --rewrite "$mode" \
      --episodes 4 --max-rounds 8 --history 1 --max-new-tokens 16 --overwrite
done
llmtool bench-agent report "$W/model" -o "$W/model-report.json"

# UltraHorizon: scripted explorers on the easier closed-menu variant with the rule judge (the default protocol,
# a free-text report, needs an LLM judge: --judge openai:URL#MODEL), CRNR vs sliding window
llmtool bench-agent uh-run script:infer "$W/uh-seq-crnr" --env seq --steps 20 --runs 8 --context crnr --window 40 --report menu --overwrite
llmtool bench-agent uh-run script:random "$W/uh-seq-random" --env seq --steps 20 --runs 8 --context sliding --window 40 --report menu --overwrite
llmtool bench-agent uh-score "$W/uh-seq-crnr" -o "$W/uh-seq-crnr.md"
