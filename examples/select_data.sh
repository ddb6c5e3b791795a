#!/usr/bin/env bash
# select-data on real offline data: GEM domains over fortunes quotes, SHIFT over reasoning-gym prompts.
set -euo pipefail
export HF_HUB_OFFLINE=1
PY=${PY:-.venv/bin/python}
W=$(mktemp -d)

# 1) a small corpus: 600 Debian fortunes (the `source` field is the fortune category)
$PY - "$W/corpus.jsonl" <<'EOF'
import json, sys, numpy as np
from llmtool.select_data.corpora import fortunes
rows = fortunes()
pick = np.random.default_rng(0).choice(len(rows), 600, replace=False)
with open(sys.argv[1], "w") as fh:
    for i in sorted(pick):
        fh.write(json.dumps(rows[i]) + "\n")
EOF
$PY -m llmtool select-data embed "$W/corpus.jsonl" -o "$W/emb.safetensors"
$PY -m llmtool select-data cluster "$W/corpus.jsonl" "$W/gem" --embeddings "$W/emb.safetensors" --k 8
$PY -m llmtool select-data cluster "$W/corpus.jsonl" "$W/kmeans" --embeddings "$W/emb.safetensors" --k 8 --method kmeans

# 2) a 21-prompt pool (3 per generator) and SHIFT vs the top-k ablation at budget 7
$PY - "$W/pool.jsonl" <<'EOF'
import json, sys, reasoning_gym
gens = ["basic_arithmetic", "chain_sum", "products", "simple_equations", "number_sorting", "spell_backward", "syllogism"]
with open(sys.argv[1], "w") as fh:
    for g in gens:
        ds = reasoning_gym.create_dataset(g, size=3, seed=0)
        for i in range(3):
            fh.write(json.dumps({"id": f"{g}-{i}", "prompt": ds[i]["question"], "answer": str(ds[i]["answer"])}) + "\n")
EOF
$PY -m llmtool select-data features "$W/pool.jsonl" "$W/feats" --model smollm2-135m --max-new-tokens 32
$PY -m llmtool select-data select "$W/pool.jsonl" --features "$W/feats" -o "$W/shift.jsonl" --budget 7
$PY -m llmtool select-data select "$W/pool.jsonl" --features "$W/feats" -o "$W/topk.jsonl" --budget 7 --method rirs-topk
echo "outputs in $W"
