"""`llmtool edit`: locate-then-edit knowledge editing (memit, alphaedit × backward/forward anchor)
and `llmtool edit keystone find|ablate|finetune`.

``llmtool edit [OPTIONS] MODEL EDITS OUT`` is routed to the ``apply`` sub-command (an
:class:`EditGroup` prepends ``apply`` whenever the first word is not a sub-command name), so both
``llmtool edit --method memit --anchor forward MODEL edits.jsonl OUT`` and
``llmtool edit apply ...`` work, next to ``llmtool edit keystone ...``.
"""
import typer
from typer.core import TyperGroup

from llmtool.core.console import OPTIONS, UsageError, emit
from llmtool.core.options import CalibData, ModelArg, OutDirArg, Overwrite
from llmtool.core.registry import MethodConfig, method_options
from llmtool.edit.methods import METHODS


class EditGroup(TyperGroup):
    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["apply", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(cls=EditGroup, no_args_is_help=True,
                  help="Knowledge editing (memit, alphaedit; backward or forward anchor) and keystone neurons.")


def parse_int_list(text: str, option: str, minimum: int = 0) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise UsageError(f"{option}: expected at least one integer, got {text!r}")
    bad = [v for v in values if v < minimum]
    if bad:
        raise UsageError(f"{option} {bad[0]}: must be >= {minimum}")
    return values


@app.command("apply")
@method_options(METHODS, default="memit")
def apply_command(
    model: ModelArg,
    edits: str = typer.Argument(..., metavar="EDITS",
                                help="Edit requests (CounterFact/zsRE JSONL) or 'counterfact-smollm2'."),
    out: OutDirArg = ...,
    config: MethodConfig = None,
    layers: str = typer.Option(None, "--layers", help="Edited decoder layers (comma-separated); default: the "
                               "model's preset (3,4,5,6,7 for SmolLM2-135M)."),
    limit: int = typer.Option(0, "--limit", min=0, help="Use only the first N requests (0 = all)."),
    edits_per_batch: int = typer.Option(0, "--edits-per-batch", min=0, help="Requests per batch; batches are "
                                        "applied in sequence with C_prev accumulating (0 = all in one batch)."),
    sequential: bool = typer.Option(False, "--sequential", help="One request per batch (= --edits-per-batch 1)."),
    calib_data: CalibData = "austen-train",
    overwrite: Overwrite = False,
) -> None:
    """Edit MODEL with the requests in EDITS and write the edited checkpoint to OUT."""
    from llmtool.core.preflight import preflight

    preflight(model, out, overwrite=overwrite)  # fail fast, before torch is imported
    from llmtool.core.checkpoint import read_config
    from llmtool.core.models import resolve_model
    from llmtool.edit.presets import preset_for
    from llmtool.edit.requests import read_requests, resolve_requests
    from llmtool.edit.run import run_edit

    preset = preset_for(read_config(resolve_model(model)))
    reqs = read_requests(resolve_requests(edits))
    if limit:
        reqs = reqs[:limit]
    cfg = config.edit_config(parse_int_list(layers, "--layers") if layers is not None else list(preset.layers),
                             preset.mom2_update_weight, batch_size=1 if sequential else edits_per_batch)
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    cached = plans.edit_stats_cached(model, cfg.layers, calib_data, config.mom2_samples, OPTIONS.seed)
    plans.announce(plans.edit(shape, len(reqs), cfg.layers, config.v_steps, config.mom2_samples, cached,
                              config.name), shape, "edit")
    manifest = run_edit(model, reqs, out, cfg, overwrite=overwrite, seed=OPTIONS.seed, stats_corpus=calib_data,
                        stats_samples=config.mom2_samples, preset=preset.name, method_config=config)
    rows = [dict(batch=i, **l) for i, b in enumerate(manifest.get("batches", [])) for l in b["layers"]]
    emit({"out": str(out), "method": config.name, "anchor": config.anchor, "requests": len(reqs),
          "layers": manifest["layers"], "batches": manifest.get("batches", [])},
         rows=rows or [{"out": str(out), "requests": 0}], title=f"{config.name} + {config.anchor} anchor")


from llmtool.edit import keystone_cli  # noqa: E402

app.add_typer(keystone_cli.app, name="keystone", help="Keystone neurons: find, ablate, keystone-only fine-tuning.")
