"""The real games behind `twx-coin` and `sciworld-find-living-thing` (optional extra llmtool[agent] + Java):
the gold-path oracle under every rewrite, their rewrite specs, translation back to the game's verbs."""
from __future__ import annotations

import shutil

import pytest

if shutil.which("java") is None:
    pytest.skip("needs a Java runtime", allow_module_level=True)
pytest.importorskip("textworld_express")
pytest.importorskip("scienceworld")

from llmtool.bench_agent.agents import make_agent  # noqa: E402
from llmtool.bench_agent.envs import ENVS, EXTERNAL, make_env  # noqa: E402
from llmtool.bench_agent.harness import Episode, run_episode  # noqa: E402
from llmtool.bench_agent.rewrite import RewriteSpec, Rewriter, display  # noqa: E402

ORDERS = ("none", "synonym", "obfuscate", "dual-ori-first", "dual-syn-first")


@pytest.fixture(scope="module", params=["twx-coin", "sciworld-find-living-thing"])
def env(request):
    return make_env(request.param)       # one game (one JVM) per env for the whole module


def test_registered_and_listed():
    assert set(EXTERNAL) == {"twx-coin", "sciworld-find-living-thing"} <= set(ENVS.names())


def test_oracle_succeeds_under_every_rewrite_with_identical_rewards(env):
    spec = RewriteSpec.for_env(env)
    oracle = make_agent("script:oracle")
    seeds = (0, 3) if env.name.startswith("sciworld") else (0, 1, 5, 9)
    for seed in seeds:
        rewards, rounds = [], []
        for mode in ORDERS:
            r = run_episode(env, oracle, mode, seed, seed, env.default_rounds, spec=spec)
            assert r["success"], (mode, r["conversation"][-3:])
            assert r["invalid_calls"] == r["deprecated_calls"] == 0
            if mode in ("none", "dual-ori-first"):
                assert r["alias_calls"] == 0 and r["orig_calls"] > 0
            else:
                assert r["orig_calls"] == 0 and r["alias_calls"] > 0
            rewards.append(r["reward"])
            rounds.append(r["rounds"])
        assert rewards == [1.0] * len(ORDERS)
        assert len(set(rounds)) == 1          # the same gold path is replayed in every mode


def test_rewrite_spec_valid_and_round_trip(env):
    spec = RewriteSpec.for_env(env)
    texts = env.sample_texts(2)
    assert spec.validate(texts) == []
    for mode in ("synonym", "obfuscate"):
        m = spec.alias_map(mode)
        assert len(set(m.values())) == len(env.IDENTIFIERS)
        for t in texts:
            there = display(t, m, spec.positions)
            assert display(there, {v: k for k, v in m.items()}, spec.positions) == t
    # a colliding alias is refused by the same validator as the built-ins
    bad = RewriteSpec.for_env(env)
    a, b = env.IDENTIFIERS[:2]
    bad.synonyms = {**bad.synonyms, b: bad.synonyms[a]}
    assert any("injective" in p for p in bad.validate(texts))


def test_obfuscated_action_reaches_the_game_as_the_original_verb(env):
    spec = RewriteSpec.for_env(env)
    rw = Rewriter(spec, "obfuscate")
    ident, arg = "move", "south" if env.name == "twx-coin" else "egg in inventory to red box"
    alias = spec.obfuscated()[ident]
    tr = rw.translate(f"{alias} {arg}")
    assert (tr.ident, tr.arg, tr.kind) == (ident, arg, "alias")
    assert rw.translate(f"{ident} {arg}").kind == "deprecated"       # strict: the original name is refused
    ep = Episode(env, "obfuscate", 0, 0, 5, spec=spec)
    sent = []
    real = env.game.step
    env.game.step = lambda text: (sent.append(text), real(text))[1]
    try:
        ep.feed(make_agent("script:oracle").act(ep.view(), ep.ctx))
    finally:
        del env.game.step
    first = env.gold[0]
    assert sent == [first] and ep.messages[-2]["content"].startswith(f"Action: {spec.obfuscated()[env.split(first)[0]]}")


def test_only_action_positions_are_rewritten(env):
    rw = Rewriter(RewriteSpec.for_env(env), "synonym")
    obs = "You move to the kitchen. The door is open.\nValid actions: look around; move east; open door to north"
    shown = rw.text(obs)
    assert shown.startswith("You move to the kitchen. The door is open.")
    syn = env.SYNONYMS
    assert shown.endswith(f"Valid actions: {syn['look around']}; {syn['move']} east; {syn['open']} door to north")
