"""`llmtool edit keystone find|ablate|finetune` (see keystone.py / keystone_sft.py)."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from llmtool.core.console import OPTIONS, UsageError, emit, info
from llmtool.core.options import ModelArg, OutDirArg, Overwrite

app = typer.Typer(no_args_is_help=True)

# the choices of `find` (the same as keystone.SCORES, which imports torch; a test keeps them equal), checked
# before the model loads
SCORES = ("worst-rank", "mean", "min")
RANK_SCOPES = ("global", "family")


def _require_keystone(neurons: Path) -> None:
    """The --neurons file exists (before torch is imported; load_keystone reads and validates it)."""
    if not Path(neurons).exists():
        raise UsageError(f"{neurons}: no such keystone file (make one with `llmtool edit keystone find`)")


def _texts(path: str, default):
    from llmtool.edit.keystone import load_texts

    return load_texts(Path(path)) if path else default()


def _tokens(tok, rows):
    """Each text's ids after the tokenizer's BOS where it adds one (Gemma), as the model saw text in training
    and as ``benchmarks/edit.py`` scores them."""
    import torch

    from llmtool.core.data import tokenize
    from llmtool.edit.prompts import bos_prefix

    bos = torch.tensor(bos_prefix(tok), dtype=torch.long)
    return [torch.cat([bos, tokenize(tok, r["text"])]) for r in rows]


@app.command("find")
def find_command(
    model: ModelArg,
    out: Path = typer.Option(Path("keystone.json"), "-o", "--out", help="Where to write the ranked neurons."),
    prompts: str = typer.Option("", "--prompts", help="Probe JSONL ({dimension, text}); default: 4 packaged probes."),
    families: str = typer.Option("q,k,v,o,gate,up,ffn", "--families", help="Candidate neuron families."),
    score: str = typer.Option("worst-rank", "--score", help="worst-rank | mean | min"),
    rank_scope: str = typer.Option("global", "--rank-scope", help="global | family"),
    skip_first_token: bool = typer.Option(False, "--skip-first-token", help="Ignore position 0 (attention sink)."),
    top: int = typer.Option(200, "--top", min=1, help="Neurons kept in the output file."),
    overwrite: Overwrite = False,
) -> None:
    """Rank neurons by cross-task activation strength and write the keystone set."""
    import hashlib

    from llmtool.core.preflight import preflight

    if score not in SCORES:
        raise UsageError(f"unknown --score {score!r}; choose one of: {', '.join(SCORES)}")
    if rank_scope not in RANK_SCOPES:
        raise UsageError(f"unknown --rank-scope {rank_scope!r}; choose global or family")
    preflight(model, out, inputs=(prompts or None,), overwrite=overwrite)  # fail fast, before torch is imported
    from llmtool.core.checkpoint import check_output
    from llmtool.core.models import load_model, load_tokenizer, resolve_model
    from llmtool.edit.keystone import default_probes, parse_families, probe_activations, rank_neurons, save_keystone

    check_output(out, overwrite)
    fams = parse_families(families)
    rows = _texts(prompts, default_probes)
    src = resolve_model(model)
    tok, m = load_tokenizer(src), load_model(src)
    acts = probe_activations(m, _tokens(tok, rows), fams, skip_first_token)
    neurons = rank_neurons(acts, score, rank_scope, top=top)
    totals = {f: int(a.shape[1] * a.shape[2]) for f, a in acts.items()}
    meta = {"model": str(src), "families": fams, "score": score, "rank_scope": rank_scope,
            "skip_first_token": skip_first_token, "totals": totals, "total_neurons": sum(totals.values()),
            "probe_sha256": hashlib.sha256(json.dumps(rows).encode()).hexdigest(),
            "tokenizer_adds_bos": bool(tok("a")["input_ids"][:1] == [tok.bos_token_id])}
    save_keystone(out, neurons, meta)
    emit({**meta, "top": [n.key for n in neurons[:30]]},
         rows=[{"rank": i, "family": n.family, "layer": n.layer, "channel": n.channel, "score": n.score,
                "mean_act": n.mean_activation} for i, n in enumerate(neurons[:20])], title=f"keystone neurons ({out})")


@app.command("ablate")
def ablate_command(
    model: ModelArg,
    neurons: Path = typer.Option(Path("keystone.json"), "--neurons", help="Output of `keystone find`."),
    k: str = typer.Option("1,5,10,30", "--k", help="Keystone set sizes to ablate."),
    eval_texts: str = typer.Option("", "--eval", help="Held-out JSONL ({dimension, text}); default: packaged."),
    random_controls: int = typer.Option(3, "--random-controls", min=0, help="Matched random sets per K."),
) -> None:
    """Perplexity with the top-K keystone neurons zeroed vs equal-size matched random sets."""
    from llmtool.core.preflight import preflight

    _require_keystone(neurons)
    preflight(model, inputs=(eval_texts or None,))  # fail fast, before torch is imported
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.edit.cli import parse_int_list
    from llmtool.edit.keystone import ablated, default_eval_texts, load_keystone, matched_random, mean_ppl

    ks = parse_int_list(k, "--k", minimum=1)
    all_neurons = load_keystone(neurons, max(ks) if ks else None)
    tok, m = load_tokenizer(model), load_model(model)
    ids = _tokens(tok, _texts(eval_texts, default_eval_texts))
    base = mean_ppl(m, ids)
    rows = []
    for kk in ks:
        sel = all_neurons[:kk]
        with ablated(m, sel):
            key_ppl = mean_ppl(m, ids)
        rand = []
        for s in range(random_controls):
            with ablated(m, matched_random(m, sel, OPTIONS.seed + s)):
                rand.append(mean_ppl(m, ids))
        rows.append({"k": kk, "base_ppl": base, "keystone_ppl": key_ppl,
                     "random_ppl_mean": sum(rand) / len(rand) if rand else float("nan"),
                     "random_ppl_max": max(rand) if rand else float("nan"), "ratio": key_ppl / base})
    emit({"model": str(model), "neurons": str(neurons), "base_ppl": base, "results": rows}, rows=rows,
         title="keystone ablation (perplexity)")


@app.command("finetune")
def finetune_command(
    model: ModelArg,
    out: OutDirArg,
    data: str = typer.Option("arithmetic", "--data", help="SFT JSONL ({prompt, response}) or 'arithmetic'."),
    trainable: str = typer.Option("keystone", "--trainable", help="keystone | random | full"),
    neurons: Path = typer.Option(Path("keystone.json"), "--neurons", help="Output of `keystone find`."),
    k: int = typer.Option(30, "--k", min=1, help="Number of keystone (or random) neurons trained."),
    lr: float = typer.Option(1e-4, "--lr", min=0.0),
    epochs: int = typer.Option(3, "--epochs", min=1),
    max_steps: int = typer.Option(0, "--max-steps", min=0, help="Stop after N steps (0 = epochs)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    weight_decay: float = typer.Option(0.0, "--weight-decay", min=0.0),
    n_train: int = typer.Option(256, "--n-train", min=1, help="Examples of the built-in task."),
    overwrite: Overwrite = False,
) -> None:
    """SFT that updates only keystone rows (baselines: --trainable full / random)."""
    from llmtool.core.preflight import preflight

    if trainable not in ("keystone", "random", "full"):
        raise UsageError(f"unknown --trainable {trainable!r}; choose keystone, random or full")
    if trainable != "full":
        _require_keystone(neurons)
    preflight(model, out, overwrite=overwrite,  # fail fast, before torch is imported
              inputs=(data if data != "arithmetic" else None,))
    from llmtool.core.data import read_jsonl
    from llmtool.core.job import job
    from llmtool.edit.keystone import load_keystone, matched_random
    from llmtool.edit.keystone_run import run_finetune
    from llmtool.edit.keystone_sft import SFTConfig, arithmetic_task

    if trainable not in ("keystone", "random", "full"):
        raise UsageError(f"unknown --trainable {trainable!r}; choose keystone, random or full")
    cfg = SFTConfig(lr=lr, epochs=epochs, weight_decay=weight_decay, batch_size=batch_size, max_steps=max_steps,
                    seed=OPTIONS.seed, trainable=trainable, k=k)
    with job("edit keystone finetune", out, overwrite=overwrite, config=cfg, model=model) as j:
        if data == "arithmetic":
            rows = arithmetic_task(n_train + 64, OPTIONS.seed)
        else:
            rows = read_jsonl(data, required=("prompt", "response"))
        tok, m = j.tokenizer, j.model
        sel = None
        if trainable != "full":
            sel = load_keystone(neurons, k)
            if trainable == "random":
                sel = matched_random(m, sel, OPTIONS.seed)
        held = rows[-64:] if data == "arithmetic" else rows[: max(1, len(rows) // 10)]
        train_rows = rows[:-64] if data == "arithmetic" else rows[len(held):]
        res, metrics = run_finetune(m, tok, j.model_path, j.dir, train_rows, held, sel, cfg, trainable)
        j.report.update(metrics)
        j.extra["run"] = {"data": data, "neurons": str(neurons) if trainable != "full" else None, "n_train": n_train}
    info(f"wrote {out}")
    emit(res)
