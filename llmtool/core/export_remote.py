"""Remote-code export of a low-rank checkpoint (``llmtool models export --format remote-code``,
``llmtool compress --export remote-code``).

The dense export (``--format dense``) gives up the saving: ``B·A`` is stored as a full matrix. This export
keeps the factors and makes plain transformers build the factorised model itself:

* ``config.json`` is the base architecture's config plus ``llmtool_lowrank_ranks`` (module -> rank), its own
  ``model_type`` (``llmtool_lowrank_<base>``, so that without ``trust_remote_code`` transformers refuses the
  directory rather than build the dense base model with random weights where the factors are) and
  ``auto_map`` pointing ``AutoConfig``/``AutoModelForCausalLM`` at ``modeling_llmtool_lowrank``;
* ``modeling_llmtool_lowrank.py`` (written next to it, ~50 lines, torch and transformers only) subclasses the
  base architecture's config and model classes and, after building it, swaps every listed Linear for a two-Linear module with
  the same tensor names as llmtool's (``lowrank_a.weight [r, in]``, ``lowrank_b.weight [out, r]``,
  ``lowrank_b.bias``), so the safetensors files are copied unchanged;
* tokenizer and generation config are copied.

Load with ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` (transformers asks for the
flag because the directory ships code; the code is the file above, readable before loading). vLLM does not
run remote modeling code of this kind; serve the dense export there.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from llmtool.core.console import UsageError

MODELING_FILE = "modeling_llmtool_lowrank.py"
CLASS_NAME = "LlmtoolLowRankForCausalLM"
CONFIG_NAME = "LlmtoolLowRankConfig"

_TEMPLATE = '''"""Low-rank model written by `llmtool models export --format remote-code`.

Every module named in ``config.llmtool_lowrank_ranks`` computes ``y = B (A x) (+ bias)`` with
``A = lowrank_a.weight [rank, in]`` and ``B = lowrank_b.weight [out, rank]``; everything else is the
base architecture ({base}).
"""
from torch import nn
from transformers import {base} as _Base
from transformers import {base_config} as _BaseConfig


class {config_cls}(_BaseConfig):
    # its own model_type: without trust_remote_code transformers refuses the directory instead of building
    # the dense base model with randomly initialised weights where the factors are
    model_type = "{model_type}"


class LowRankLinear(nn.Module):
    def __init__(self, in_features, out_features, rank, bias=False, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.lowrank_a = nn.Linear(in_features, rank, bias=False, dtype=dtype, device=device)
        self.lowrank_b = nn.Linear(rank, out_features, bias=bias, dtype=dtype, device=device)

    def forward(self, x):
        return self.lowrank_b(self.lowrank_a(x))


class {cls}(_Base):
    config_class = {config_cls}

    def __init__(self, config):
        super().__init__(config)
        for name, rank in (getattr(config, "llmtool_lowrank_ranks", None) or {{}}).items():
            parent, _, child = name.rpartition(".")
            owner = self.get_submodule(parent)
            old = getattr(owner, child)
            setattr(owner, child, LowRankLinear(old.in_features, old.out_features, int(rank),
                                                bias=old.bias is not None, dtype=old.weight.dtype,
                                                device=old.weight.device))
'''


def check_lowrank(src, config: dict) -> None:
    """The remote-code export is for low-rank checkpoints (torch-free, for the preflight)."""
    if "llmtool_lowrank" not in config:
        raise UsageError(f"{src}: remote-code export needs a low-rank checkpoint of `llmtool compress` (config.json "
                         "has no llmtool_lowrank block); use --format dense")


def save_remote_code(src: Path, out_dir: Path) -> dict:
    """Write the remote-code export of the low-rank checkpoint ``src`` into ``out_dir``."""
    import transformers

    from llmtool.core.checkpoint import SAFE_INDEX, base_config_dict, copy_tokenizer, read_config, weight_files

    src, out_dir = Path(src), Path(out_dir)
    config = read_config(src)
    check_lowrank(src, config)
    cfg = base_config_dict(config)
    block = cfg.pop("llmtool_lowrank")
    base = (cfg.get("architectures") or [None])[0]
    if not base or not hasattr(transformers, base):
        raise UsageError(f"{src}/config.json: base architecture {base!r} is not a transformers class")
    from transformers import CONFIG_MAPPING

    base_type = cfg.get("model_type")
    if base_type not in CONFIG_MAPPING:
        raise UsageError(f"{src}/config.json: base model_type {base_type!r} is not known to transformers")
    model_type = f"llmtool_lowrank_{base_type}"
    cfg["llmtool_lowrank_ranks"] = dict(block["ranks"])
    cfg["model_type"] = model_type
    cfg["architectures"] = [CLASS_NAME]
    cfg["auto_map"] = {"AutoConfig": f"{MODELING_FILE[:-3]}.{CONFIG_NAME}",
                       "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{CLASS_NAME}"}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / MODELING_FILE).write_text(_TEMPLATE.format(
        base=base, cls=CLASS_NAME, base_config=CONFIG_MAPPING[base_type].__name__, config_cls=CONFIG_NAME,
        model_type=model_type))
    for f in weight_files(src):
        shutil.copy2(f, out_dir / f.name)
    if (src / SAFE_INDEX).is_file():
        shutil.copy2(src / SAFE_INDEX, out_dir / SAFE_INDEX)
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", out_dir / "generation_config.json")
    copy_tokenizer(src, out_dir)
    return {"base_architecture": base, "factorised_modules": len(block["ranks"]),
            "load_with": "AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)"}
