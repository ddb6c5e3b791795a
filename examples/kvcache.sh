#!/usr/bin/env bash
# llmtool kvcache on the packaged default model: eviction (with/without CriticalKV) and KV quantization.
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# one needle ("The special magic number for copper is: ...") in ~450 tokens of Austen-like filler
llmtool example-data kvcache-prompts -o "$TMP/prompts.jsonl" --n 1
# greedy generation, 20 % cache, SnapKV vs SnapKV + CriticalKV (question-agnostic protocol)
llmtool kvcache generate "$MODEL" --prompts "$TMP/prompts.jsonl" --max-new-tokens 8 --method snapkv --budget 0.2
llmtool kvcache generate "$MODEL" --prompts "$TMP/prompts.jsonl" --max-new-tokens 8 --method snapkv --budget 0.2 --critical
# 2-bit KIVI vs PatternKV
llmtool kvcache generate "$MODEL" --prompts "$TMP/prompts.jsonl" --max-new-tokens 8 --method kivi --bits 2
llmtool kvcache generate "$MODEL" --prompts "$TMP/prompts.jsonl" --max-new-tokens 8 --method patternkv --bits 2

# RULER-style needle retrieval at 512 tokens and decode perplexity on real text
llmtool kvcache evaluate "$MODEL" --task niah_single --length 512 --samples 2 --method adakv --budget 0.2 --critical
llmtool --json kvcache evaluate "$MODEL" --task ppl --prefix 512 --continuation 128 --samples 1 --method patternkv --bits 2
