#!/usr/bin/env bash
# Statistics over result files: best-model identification (SySRs), judge aggregation (BTD),
# autograder-bias GLMs. Everything runs on CPU; nothing here loads a model except the live SySRs step.
set -euo pipefail
OUT=${OUT:-/tmp/llmtool-evaluate-example}
rm -rf "$OUT" && mkdir -p "$OUT"

# 1. Best model under a 5% budget on a synthetic IRT matrix (planted truth), then the bandit comparison.
python - "$OUT/irt.csv" <<'EOF'
import sys
from pathlib import Path
from llmtool.evaluate.bai_sim import synthetic_irt
from llmtool.evaluate.results_io import write_wide
write_wide(synthetic_irt(k=10, n=2000, gap=0.05, spread=3.0, seed=0), Path(sys.argv[1]))
EOF
llmtool evaluate sysr --responses "$OUT/irt.csv" --budget-frac 0.05 --seed 0 -o "$OUT/sysr_run.json"
llmtool evaluate bai-sim --synthetic irt --k 10 --n 2000 --gap 0.05 --spread 3.0 \
    --methods sysr,sr,sh,sh-shared,uniform,uniform-shared,ucbe --budget-fracs 0.02,0.05,0.1 --reps 100 \
    -o "$OUT/bai_results.csv"

# 2. The same on the real per-item matrix of SmolLM2-135M variants measured by benchmarks/evaluate.py (packaged).
llmtool example-data score-matrix -o "$OUT/matrix.csv"
llmtool evaluate sysr --responses "$OUT/matrix.csv" --budget-frac 0.1 -o "$OUT/real_run.json"

# 3. Live mode: two default-model entries answer only the requested questions (cache makes it resumable).
cat > "$OUT/models.yaml" <<'EOF'
- {name: smollm2-a, path: smollm2-135m, max_new_tokens: 8, chat: true}
- {name: smollm2-b, path: smollm2-135m, max_new_tokens: 2, chat: true}
EOF
python - "$OUT/bench.jsonl" <<'EOF'
import json, sys
caps = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"), ("Egypt", "Cairo")]
with open(sys.argv[1], "w") as fh:
    for i, (c, r) in enumerate(caps):
        fh.write(json.dumps({"id": f"cap{i}", "prompt": f"What is the capital of {c}? Answer with one word.", "reference": r}) + "\n")
EOF
llmtool evaluate sysr --models "$OUT/models.yaml" --queries "$OUT/bench.jsonl" --scorer contains --budget 8 -o "$OUT/live.json"

# 4. Judge aggregation: synthetic votes (half shown in BA order) + human labels with planted parameters.
llmtool evaluate judge-synth "$OUT/judge" --items 1000 --n 20 --seed 0
llmtool evaluate judge --votes "$OUT/judge/votes.jsonl" --human "$OUT/judge/human.jsonl" --frame presented \
    --nu-mode item -o "$OUT/judge/agg.jsonl"

# 5. Autograder bias GLMs on the HiBayES example data (q2: self-preference; q5: length bias).
DATA="$OUT/hibayes"
for q in q2 q4 q5; do llmtool example-data "hibayes-$q" -o "$DATA/$q.csv"; done
llmtool evaluate autograder fit --data "$DATA/q2.csv" --levels 0:10 --effects grader,LLM --interactions grader:LLM \
    --chains 2 --samples 500 --warmup 500 -o "$OUT/fits/q2_int"
llmtool evaluate autograder fit --data "$DATA/q2.csv" --levels 0:10 --effects grader,LLM \
    --chains 2 --samples 500 --warmup 500 -o "$OUT/fits/q2_plain"
llmtool evaluate autograder compare "$OUT/fits/q2_int" "$OUT/fits/q2_plain" --criterion loo
llmtool evaluate autograder fit --data "$DATA/q5.csv" --outcome first_is_chosen --kind pairwise \
    --effects llm_pair,grader --slopes length_diff:grader --standardise length_diff \
    --chains 2 --samples 500 --warmup 500 -o "$OUT/fits/q5_len"
llmtool evaluate autograder fit --data "$DATA/q4.csv" --levels 0:10 --effects grader,item --interactions grader:item \
    --agreement-units item,LLM --counterfactual grader_effects --chains 2 --samples 500 --warmup 500 -o "$OUT/fits/q4"
