"""`llmtool bench-agent`: an agent harness with PIPE interface rewrites and Interface Reliance
(Gu et al., "What Do Agents Learn from Trajectory-SFT: Semantics or Interfaces?", arXiv 2602.01611)
and the UltraHorizon long-horizon rule-discovery environments (Luo et al., arXiv 2509.21766).

Modules (one job each): ``envs`` (compact PIPE environments, text protocol), ``rewrite`` (rewrite
specs, validation, display/action translation, strict and dual modes), ``metrics`` (SR, drops,
Interface Reliance with bootstrap CIs), ``agents`` (``script:``, ``hf:``, ``openai:`` backends and the
tolerant action parser), ``toolparse`` (tool-call formats), ``harness`` (episode loop, resumable
JSONL runs), ``uh`` (UltraHorizon environments, tool schemas, rule and LLM judges), ``uhrun``
(UltraHorizon agent loop, notes, context policies, scoring), ``cli`` (the Typer app).
"""
