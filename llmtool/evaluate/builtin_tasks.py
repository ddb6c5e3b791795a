"""The evaluate area's own tasks for :mod:`llmtool.evaluate.tasks`.

* ``ppl`` — perplexity of the model on ``options.data`` (the fixed protocol of
  :func:`llmtool.core.evalkit.perplexity`, as ``llmtool evaluate ppl``).
* ``retention`` — how much of a reference model's language modelling a changed model keeps:
  ``retention = ppl(base) / ppl(model)`` on the same text and protocol (1 = all kept, < 1 = worse
  than the base). ``options.base`` is the model before editing / fine-tuning (reconstructed choice:
  a perplexity ratio on held-out text, as keystone-neuron SFT reports retention perplexity).
"""
from __future__ import annotations


def _ppl(model, tokenizer, options):
    from llmtool.core import data as data_mod
    from llmtool.core.evalkit import perplexity

    ids = data_mod.tokenize(tokenizer, data_mod.load_text(options.data))
    return perplexity(model, ids, seqlen=options.seqlen, stride=options.seqlen, max_tokens=options.max_tokens,
                      batch_size=options.batch_size, bos_token_id=data_mod.scoring_bos(tokenizer))


def ppl(model, tokenizer, options) -> dict:
    r = _ppl(model, tokenizer, options)
    return {"ppl": r.ppl, "nll": r.nll, "tokens": r.tokens, "data": options.data}


def retention(model, tokenizer, options) -> dict:
    from llmtool.core.console import UsageError
    from llmtool.core.models import load_model, load_tokenizer

    if not options.base:
        raise UsageError("task retention needs --base MODEL (the model before editing / training)")
    after = _ppl(model, tokenizer, options)
    base_model = load_model(options.base)
    before = _ppl(base_model, load_tokenizer(options.base), options)
    del base_model
    return {"retention": before.ppl / after.ppl, "ppl": after.ppl, "ppl_base": before.ppl, "data": options.data}


def tasks() -> dict:
    return {"ppl": (ppl, "Perplexity on --data (evaluate ppl's protocol)."),
            "retention": (retention, "ppl(--base) / ppl(MODEL) on --data: language modelling kept.")}
