"""Attack methods of ``llmtool evade attack`` (one registry, one small function each).

Every attack maps watermarked texts to attacked texts plus per-item fields:
- ``bira``: suppression set from the aux LM (default: the paraphraser itself), mapped to the
  paraphraser's tokenizer through strings when the two tokenizers differ, then the adaptive
  biased-paraphrase loop (see :mod:`llmtool.evade.bira`);
- ``vanilla`` (alias ``paraphrase``): the same prompt and decoding with beta = 0, one pass;
- ``word-delete`` / ``synonym``: cheap edits (see :mod:`llmtool.evade.edits`);
- ``emoji``: generation-time attack — the *watermarked* generator is asked to put an emoji after
  every word, with the watermark on, and the emojis are stripped before detection.

The options of each attack are its config in :mod:`llmtool.evade.attack_methods` (the method
contract); a config's ``attack`` names its function in :data:`ATTACKS`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmtool.core.registry import Registry
from llmtool.evade.bira import BiraConfig, adaptive_attack, map_to_tokenizer, suppression_set

ATTACKS: Registry = Registry("evade attack")


@dataclass
class AttackContext:
    paraphraser: object = None          # llmtool.evade.paraphrase.Paraphraser
    aux_model: object = None
    aux_tokenizer: object = None
    bira: BiraConfig = field(default_factory=BiraConfig)
    delete_ratio: float = 0.3
    synonym_ratio: float = 0.5
    seed: int = 0
    generator: object = None            # emoji attack: watermarked model, tokenizer, scheme, decode
    generator_tokenizer: object = None
    scheme: object = None
    decode: object = None
    prompts: list | None = None


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True).strip()


def suppression_sets(texts: list[str], para, aux_model=None, aux_tokenizer=None, percentile: float = 0.0) -> list[list[int]]:
    """BIRA's suppression set of each text in the paraphraser's vocabulary (surprisal under ``aux_model``,
    default the paraphraser; carried across tokenizers when the auxiliary LM's differs)."""
    from llmtool.core.console import progress

    aux_model = aux_model or para.model
    aux_tok = aux_tokenizer or para.tokenizer
    same_tok = aux_tok is para.tokenizer or aux_tok.get_vocab() == para.tokenizer.get_vocab()
    sets = []
    for text in progress(texts, "suppression sets"):
        s = suppression_set(aux_model, aux_tok, text, percentile)
        sets.append(s if same_tok else map_to_tokenizer(s, aux_tok, para.tokenizer, limit=None))
    return sets


@ATTACKS.register("bira")
def attack_bira(texts: list[str], ctx: AttackContext) -> list[dict]:

    para = ctx.paraphraser
    sets = suppression_sets(texts, para, ctx.aux_model, ctx.aux_tokenizer, ctx.bira.percentile)
    lengths = [para.source_length(t) for t in texts]
    pass_no = [0]

    def run(indices: list[int], betas: list[float]) -> list[list[int]]:
        pass_no[0] += 1
        return para.rewrite_ids([texts[i] for i in indices], [sets[i] for i in indices], betas,
                                seed=ctx.seed + 100003 * (pass_no[0] - 1))

    outcomes = adaptive_attack(run, len(texts), lengths, ctx.bira)
    return [{"attacked_text": _decode(para.tokenizer, o.ids), "beta_final": o.beta_final,
             "iterations": o.iterations, "degenerated": o.degenerated, "suppression_size": len(s)}
            for o, s in zip(outcomes, sets)]


def _vanilla(texts: list[str], ctx: AttackContext) -> list[dict]:
    from llmtool.evade.bira import is_degenerate

    para = ctx.paraphraser
    outs = para.rewrite_ids(texts, seed=ctx.seed)
    return [{"attacked_text": _decode(para.tokenizer, y), "beta_final": 0.0, "iterations": 1,
             "degenerated": is_degenerate(y, para.source_length(t)), "suppression_size": 0}
            for t, y in zip(texts, outs)]


ATTACKS.add("vanilla", _vanilla)
ATTACKS.add("paraphrase", _vanilla)


@ATTACKS.register("word-delete")
def attack_word_delete(texts: list[str], ctx: AttackContext) -> list[dict]:
    from llmtool.evade.edits import delete_words

    return [{"attacked_text": delete_words(t, ctx.delete_ratio, ctx.seed + i)} for i, t in enumerate(texts)]


@ATTACKS.register("synonym")
def attack_synonym(texts: list[str], ctx: AttackContext) -> list[dict]:
    from llmtool.evade.edits import EmbeddingSynonyms

    syn = EmbeddingSynonyms(ctx.paraphraser.model, ctx.paraphraser.tokenizer)
    return [{"attacked_text": syn.substitute(t, ctx.synonym_ratio, ctx.seed + i)} for i, t in enumerate(texts)]


@ATTACKS.register("emoji")
def attack_emoji(texts: list[str], ctx: AttackContext) -> list[dict]:
    from llmtool.evade.edits import EMOJI_INSTRUCTION, strip_emoji
    from llmtool.evade.generation import generate_ids, scheme_decoding

    tok = ctx.generator_tokenizer
    prompt_ids = []
    for p in ctx.prompts:
        msgs = [{"role": "user", "content": EMOJI_INSTRUCTION + p}]
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) \
            if getattr(tok, "chat_template", None) else EMOJI_INSTRUCTION + p
        prompt_ids.append(tok(rendered, add_special_tokens=False)["input_ids"])
    outs = generate_ids(ctx.generator, tok, prompt_ids, [ctx.scheme.processor()], ctx.decode,
                        **scheme_decoding(ctx.scheme))
    return [{"attacked_text": strip_emoji(_decode(tok, y)), "emoji_raw_text": _decode(tok, y)} for y in outs]
