"""kvcache's contribution to ``llmtool evaluate tasks`` (the provider hook of
:mod:`llmtool.evaluate.tasks`, which imports this module by name): the seeded RULER-style
synthetic tasks of :mod:`llmtool.kvcache.tasks`, measured with the model's own (full) cache, exactly
as ``llmtool kvcache evaluate --method full --task NAME`` measures them."""
from __future__ import annotations

from llmtool.kvcache.tasks import TASKS


def _runner(name: str):
    def run(model, tokenizer, options) -> dict:
        from llmtool.core.console import UsageError
        from llmtool.kvcache.cli import evaluate_spec
        from llmtool.kvcache.pipeline import KVSpec

        if options.length < 64:
            raise UsageError(f"--length {options.length}: must be at least 64 tokens")
        r = evaluate_spec(model, tokenizer, KVSpec(seed=options.seed), name, options.length, options.samples,
                          options.seed, options.data, 0, 0, filler=options.filler)
        keep = ("accuracy",) + tuple(k for k in r if k.startswith("acc_"))
        return {**{k: r[k] for k in keep}, "length": options.length, "samples": options.samples}

    return run


def tasks() -> dict:
    out = {name: (_runner(name), f"RULER-style {name} accuracy (%) at --length tokens.") for name in TASKS}
    out["ruler"] = (_runner("ruler"), "Mean accuracy (%) over the four RULER-style tasks.")
    return out
