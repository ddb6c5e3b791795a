"""`llmtool edit`: locate-then-edit knowledge editing (memit, alphaedit × backward/forward anchor)
and `llmtool edit keystone find|ablate|finetune`.

``llmtool edit [OPTIONS] MODEL EDITS OUT`` is routed to the ``apply`` sub-command (an
:class:`EditGroup` prepends ``apply`` whenever the first word is not a sub-command name), so both
``llmtool edit --method memit --anchor forward MODEL edits.jsonl OUT`` and
``llmtool edit apply ...`` work, next to ``llmtool edit keystone ...``.
"""
from __future__ import annotations

from pathlib import Path

import typer
from typer.core import TyperGroup

from llmtool.core.console import OPTIONS, UsageError, emit
from llmtool.core.options import ModelArg, OutDirArg, Overwrite


class EditGroup(TyperGroup):
    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["apply", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(cls=EditGroup, no_args_is_help=True,
                  help="Knowledge editing (memit, alphaedit; backward or forward anchor) and keystone neurons.")


def parse_int_list(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated integers, got {text!r}") from None


@app.command("apply")
def apply_command(
    model: ModelArg,
    edits: str = typer.Argument(..., metavar="EDITS",
                                help="Edit requests (CounterFact/zsRE JSONL) or 'counterfact-smollm2'."),
    out: OutDirArg = Path("edited"),
    method: str = typer.Option("memit", "--method", help="memit | alphaedit"),
    anchor: str = typer.Option("backward", "--anchor", help="backward (MEMIT spreading) | forward (FE replay)"),
    layers: str = typer.Option(None, "--layers", help="Edited decoder layers (comma-separated); default: the "
                               "model's preset (3,4,5,6,7 for SmolLM2-135M)."),
    limit: int = typer.Option(0, "--limit", min=0, help="Use only the first N requests (0 = all)."),
    batch_size: int = typer.Option(0, "--batch-size", min=0, help="Requests per batch; batches are applied in "
                                   "sequence with C_prev accumulating (0 = all in one batch)."),
    sequential: bool = typer.Option(False, "--sequential", help="One request per batch (= --batch-size 1)."),
    v_lr: float = typer.Option(0.1, "--v-lr", min=0.0, help="Adam lr of the target optimisation."),
    v_steps: int = typer.Option(25, "--v-steps", min=1, help="Gradient steps of the target optimisation."),
    clamp_norm: float = typer.Option(0.75, "--clamp-norm", min=0.0, help="‖δ‖ ≤ clamp·‖h‖."),
    kl_factor: float = typer.Option(0.0625, "--kl-factor", min=0.0),
    v_weight_decay: float = typer.Option(0.5, "--v-weight-decay", min=0.0),
    mom2_weight: float = typer.Option(None, "--mom2-weight", min=0.0, help="λ on the mean key second moment; "
                                      "default: the model's preset (1500 for SmolLM2-135M, 15000 in the papers)."),
    mom2_samples: int = typer.Option(20000, "--mom2-samples", min=1, help="Token positions for the statistics."),
    stats_corpus: str = typer.Option("austen-train", "--stats-corpus", help="Text for the key statistics."),
    l2: float = typer.Option(None, "--l2", help="μ for memit (default 0) / α for alphaedit (default 10)."),
    nullspace_threshold: float = typer.Option(0.02, "--nullspace-threshold", min=0.0, help="AlphaEdit."),
    z_batch: int = typer.Option(8, "--z-batch", min=1, help="Requests whose targets are optimised together "
                                "(speed and memory only; results are the same)."),
    overwrite: Overwrite = False,
) -> None:
    """Edit MODEL with the requests in EDITS and write the edited checkpoint to OUT."""
    import torch

    from llmtool.edit.anchors import ANCHORS, ZConfig
    from llmtool.edit.memit import METHODS, EditConfig
    from llmtool.edit.requests import read_requests, resolve_requests
    from llmtool.edit.run import run_edit
    import llmtool.edit.alphaedit  # noqa: F401  (registers the method)

    torch.set_num_threads(min(2, torch.get_num_threads()))
    METHODS.get(method)
    if anchor not in ANCHORS:
        raise UsageError(f"unknown --anchor {anchor!r}; choose one of: {', '.join(ANCHORS)}")
    from llmtool.core.checkpoint import read_config
    from llmtool.core.models import resolve_model
    from llmtool.edit.presets import preset_for

    preset = preset_for(read_config(resolve_model(model)))
    reqs = read_requests(resolve_requests(edits))
    if limit:
        reqs = reqs[:limit]
    cfg = EditConfig(layers=parse_int_list(layers, "--layers") if layers is not None else list(preset.layers),
                     method=method, anchor=anchor,
                     z=ZConfig(v_lr=v_lr, v_num_grad_steps=v_steps, clamp_norm_factor=clamp_norm,
                               kl_factor=kl_factor, v_weight_decay=v_weight_decay),
                     mom2_update_weight=preset.mom2_update_weight if mom2_weight is None else mom2_weight,
                     l2=l2, nullspace_threshold=nullspace_threshold,
                     batch_size=1 if sequential else batch_size, z_batch=z_batch)
    manifest = run_edit(model, reqs, out, cfg, overwrite=overwrite, seed=OPTIONS.seed, stats_corpus=stats_corpus,
                        stats_samples=mom2_samples, preset=preset.name)
    rows = [dict(batch=i, **l) for i, b in enumerate(manifest.get("batches", [])) for l in b["layers"]]
    emit({"out": str(out), "method": method, "anchor": anchor, "requests": len(reqs), "layers": manifest["layers"],
          "batches": manifest.get("batches", [])}, rows=rows or [{"out": str(out), "requests": 0}],
         title=f"{method} + {anchor} anchor")


from llmtool.edit import keystone_cli  # noqa: E402

app.add_typer(keystone_cli.app, name="keystone", help="Keystone neurons: find, ablate, keystone-only fine-tuning.")
