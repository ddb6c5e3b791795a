"""LLM-PV propose-and-verify program learning (`llmtool learn-program`, `llmtool tasks`)."""
