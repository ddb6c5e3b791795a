"""The control agent of the Interface Reliance experiment (issue 42).

The base model's IR gate (IR in [0.5, 2]) holds by definition when the untrained model never acts. The
control is an agent that *can* act but was never trained on the environment's names: it is fine-tuned on
the same oracle trajectories as the fine-tuned agent, except that every training episode shows the
interface under fresh random aliases (:func:`random_alias_spec`: the prompt, the action list and every
observation use them, the oracle answers with them). It learns to read the names from the prompt, never a
fixed name set, so at evaluation neither the original names nor the synonyms are familiar and its IR
should be about 1 (a policy that copies the first listed name has IR exactly 1). An instruct model through
``openai:`` is the other control the issue names; it needs a server this project's CPU runs do not have.
"""
from __future__ import annotations

import random

from llmtool.bench_agent.rewrite import RewriteSpec

_CONS, _VOW = "bdfgklmnprstvz", "aeiou"


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_CONS) + rng.choice(_VOW) for _ in range(syllables))


def random_alias_spec(env, rng: random.Random, task_texts: list[str] = (), tries: int = 200) -> RewriteSpec:
    """A valid rewrite spec for ``env`` whose ``synonym`` aliases are random pronounceable identifiers
    (``word_word`` for names with an underscore, one word otherwise), drawn from ``rng``; redrawn until
    :meth:`RewriteSpec.validate` passes (injective, no substring overlaps, absent from ``task_texts``)."""
    base = RewriteSpec.for_env(env)
    for _ in range(tries):
        syn = {}
        for a in base.actions:          # keep the name's shape: one word per part, the same separator
            sep = " " if " " in a else "_"
            syn[a] = sep.join(_word(rng, 2) for _ in a.split(sep))
        spec = RewriteSpec(env=base.env, actions=base.actions, synonyms=syn, obfuscation=dict(base.obfuscation),
                           dual_supported=base.dual_supported, surfaces=base.surfaces, positions=base.positions)
        if not spec.validate(list(task_texts)):
            return spec
    raise ValueError(f"no valid random alias spec for {base.env} in {tries} draws")


def control_episodes(env_name: str, n_tasks: int, seed: int, history: int | None = None) -> list[dict]:
    """Oracle episodes for the control's training data: episode i runs under its own random alias spec
    (``synonym`` mode, strict), so no training turn shows the environment's original names."""
    from llmtool.bench_agent.agents import make_agent
    from llmtool.bench_agent.envs import make_env
    from llmtool.bench_agent.harness import run_episode

    rng = random.Random(1_000_003 * (seed + 1))
    oracle = make_agent("script:oracle")
    probe = make_env(env_name)
    texts = probe.sample_texts(8)
    out = []
    for i in range(n_tasks):
        env = make_env(env_name)
        spec = random_alias_spec(env, rng, texts)
        rec = run_episode(env, oracle, "synonym", i, 10_000_000 + seed * 100003 + i, env.default_rounds,
                          history=history, spec=spec)
        rec["aliases"] = dict(spec.synonyms)
        out.append(rec)
    return out
