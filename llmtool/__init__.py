"""llmtool: recent LLM research methods and their baselines, on local Hugging Face checkpoints."""

__version__ = "0.1.0"


def load(model, dtype=None, device=None):
    """Load a checkpoint written by llmtool (or any HF causal LM dir, or a default alias)."""
    from llmtool.core.models import load_model

    return load_model(model, dtype=dtype, device=device)


def load_tokenizer(model):
    from llmtool.core.models import load_tokenizer as _lt

    return _lt(model)
