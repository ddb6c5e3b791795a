"""Per-item result files -> a (models x items) score matrix for best-model identification.

Accepted inputs (format chosen from the file suffix and its columns):

* wide CSV / parquet: a column ``item_id`` and one column per model, scores in [0, 1];
* long CSV / parquet: columns ``model``, ``item_id``, ``score`` (+ optional ``sample`` for repeated
  stochastic generations of one (model, item) pair);
* lm-evaluation-harness ``--log_samples`` JSONL (``samples_<task>_*.jsonl``): one file per model, item id
  from ``doc_id``, score from a metric field (``acc``, ``exact_match``, ``acc_norm``... or ``--metric``).
  The model name is given as ``NAME=path.jsonl``; without it the name of the file's parent folder is used.

Every problem is a one-line :class:`UsageError` naming the file, the row (or line) and the field:
missing ``item_id``/model columns, a non-numeric or out-of-range cell, a duplicated item id, a duplicated
model column or (model, item[, sample]) row, or fewer than two models. Items missing a score for some model
are dropped by :func:`complete_items` (and the count is reported) unless the caller keeps them.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from llmtool.core.console import UsageError

LM_EVAL_METRICS = ("acc", "exact_match", "acc_norm", "em", "f1", "pass@1", "bleu")


@dataclass
class ScoreMatrix:
    """Scores of K models on N items. ``scores[a, j]`` is the mean over stored samples (NaN = missing);
    ``samples[a, j]`` (optional) holds the individual stochastic samples, NaN-padded to a common length."""

    models: list[str]
    item_ids: list[str]
    scores: np.ndarray
    samples: np.ndarray | None = None
    source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scores.shape  # type: ignore[return-value]

    def means(self) -> np.ndarray:
        return np.nanmean(self.scores, axis=1)

    def best(self) -> list[int]:
        """Indices of the models with the maximal full-benchmark mean (exact ties all count)."""
        mu = self.scores.mean(axis=1)
        return [int(i) for i in np.flatnonzero(np.isclose(mu, mu.max(), rtol=0, atol=1e-12))]

    def subset_models(self, names: Sequence[str]) -> "ScoreMatrix":
        missing = [n for n in names if n not in self.models]
        if missing:
            raise UsageError(f"{self.source}: model(s) not in the matrix: {', '.join(missing)} "
                             f"(models: {', '.join(self.models)})")
        idx = [self.models.index(n) for n in names]
        return ScoreMatrix(list(names), self.item_ids, self.scores[idx],
                           None if self.samples is None else self.samples[idx], self.source, list(self.notes))

    def permuted(self, order: Sequence[int]) -> "ScoreMatrix":
        order = list(order)
        return ScoreMatrix([self.models[i] for i in order], self.item_ids, self.scores[order],
                           None if self.samples is None else self.samples[order], self.source, list(self.notes))

    def to_rows(self) -> list[dict]:
        """Wide rows (``item_id`` + one column per model)."""
        return [{"item_id": iid, **{m: float(self.scores[a, j]) for a, m in enumerate(self.models)}}
                for j, iid in enumerate(self.item_ids)]

    def summary(self) -> dict:
        """Top-two gap and disagreement rate (the pitfall section asks for both per benchmark)."""
        mu = self.scores.mean(axis=1)
        order = np.argsort(-mu)
        a, b = order[0], order[1]
        return {"models": len(self.models), "items": len(self.item_ids),
                "best": [self.models[i] for i in self.best()], "best_mean": float(mu[a]),
                "top2_gap": float(mu[a] - mu[b]),
                "top2_disagreement": float(np.mean(self.scores[a] != self.scores[b])),
                "binary": bool(np.isin(self.scores, (0.0, 1.0)).all())}


def _cell(value, where: str) -> float:
    if value is None or (isinstance(value, str) and value.strip() in ("", "nan", "NaN", "NA", "null")):
        return math.nan
    if isinstance(value, bool):
        return float(value)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: non-numeric score {value!r}") from None
    if math.isnan(x):
        return x
    if not (0.0 <= x <= 1.0) or math.isinf(x):
        raise UsageError(f"{where}: score {x} outside [0, 1] (rescale bounded metrics to [0, 1] first)")
    return x


def _read_columns(path: Path) -> tuple[list[str], list[list]]:
    """Header and rows of a CSV or parquet file, without merging duplicated column names."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises many types for corrupt files
            raise UsageError(f"{path}: cannot read parquet ({e})") from None
        header = list(table.column_names)
        cols = [table.column(i).to_pylist() for i in range(table.num_columns)]
        rows = [list(r) for r in zip(*cols)] if cols else []
        return header, rows
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            try:
                header = next(reader)
            except StopIteration:
                raise UsageError(f"{path}: empty file") from None
            rows = []
            for line_no, r in enumerate(reader, 2):
                if not r:
                    continue
                if len(r) != len(header):
                    raise UsageError(f"{path}:{line_no}: {len(r)} fields, header has {len(header)}")
                rows.append(r)
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except csv.Error as e:
        raise UsageError(f"{path}: malformed CSV ({e})") from None
    return [h.strip() for h in header], rows


def _row_label(path: Path, i: int) -> str:
    # CSV: header is line 1, first data row is line 2; parquet: 0-based row index.
    return f"{path}:{i + 2}" if path.suffix != ".parquet" else f"{path}:row {i}"


def read_table_matrix(path: Path) -> ScoreMatrix:
    header, rows = _read_columns(path)
    dup = sorted({h for h in header if header.count(h) > 1})
    if dup:
        raise UsageError(f"{path}: duplicated column(s) {', '.join(dup)}")
    if "item_id" not in header:
        raise UsageError(f"{path}: missing column 'item_id' (wide: item_id + one column per model; "
                         "long: model, item_id, score)")
    if not rows:
        raise UsageError(f"{path}: no rows")
    if {"model", "score"} <= set(header):
        return _long_matrix(path, header, rows)
    return _wide_matrix(path, header, rows)


def _wide_matrix(path: Path, header: list[str], rows: list[list]) -> ScoreMatrix:
    id_col = header.index("item_id")
    model_cols = [i for i, h in enumerate(header) if i != id_col]
    if len(model_cols) < 2:
        raise UsageError(f"{path}: need at least two model columns besides 'item_id', found {len(model_cols)}")
    for i in model_cols:
        if not header[i]:
            raise UsageError(f"{path}: a model column has an empty name")
    ids, seen = [], {}
    scores = np.full((len(model_cols), len(rows)), np.nan)
    for r, row in enumerate(rows):
        iid = str(row[id_col]).strip() if row[id_col] is not None else ""
        if not iid:
            raise UsageError(f"{_row_label(path, r)}: empty item_id")
        if iid in seen:
            raise UsageError(f"{_row_label(path, r)}: duplicate item_id {iid!r} (first at "
                             f"{_row_label(path, seen[iid])})")
        seen[iid] = r
        ids.append(iid)
        for a, c in enumerate(model_cols):
            scores[a, r] = _cell(row[c], f"{_row_label(path, r)}: column {header[c]!r}")
    _check_models_present(path, [header[c] for c in model_cols], scores)
    return ScoreMatrix([header[c] for c in model_cols], ids, scores, source=str(path))


def _long_matrix(path: Path, header: list[str], rows: list[list]) -> ScoreMatrix:
    ci = {h: header.index(h) for h in ("model", "item_id", "score")}
    sample_col = header.index("sample") if "sample" in header else None
    cells: dict[tuple[str, str], list[float]] = {}
    seen: dict[tuple, int] = {}
    models: list[str] = []
    items: list[str] = []
    model_set: set[str] = set()
    item_set: set[str] = set()
    for r, row in enumerate(rows):
        where = _row_label(path, r)
        model, iid = row[ci["model"]], row[ci["item_id"]]
        if model is None or not str(model).strip():
            raise UsageError(f"{where}: empty 'model'")
        if iid is None or not str(iid).strip():
            raise UsageError(f"{where}: empty 'item_id'")
        model, iid = str(model).strip(), str(iid).strip()
        key = (model, iid, None if sample_col is None else str(row[sample_col]))
        if key in seen:
            what = f"(model {model!r}, item_id {iid!r}" + ("" if sample_col is None else f", sample {key[2]!r}") + ")"
            raise UsageError(f"{where}: duplicate row {what} (first at {_row_label(path, seen[key])})")
        seen[key] = r
        x = _cell(row[ci["score"]], f"{where}: column 'score'")
        if model not in model_set:
            model_set.add(model)
            models.append(model)
        if iid not in item_set:
            item_set.add(iid)
            items.append(iid)
        if not math.isnan(x):
            cells.setdefault((model, iid), []).append(x)
    if len(models) < 2:
        raise UsageError(f"{path}: need at least two models, found {len(models)}")
    m_idx = {m: a for a, m in enumerate(models)}
    i_idx = {i: j for j, i in enumerate(items)}
    depth = max(len(v) for v in cells.values()) if cells else 1
    samples = np.full((len(models), len(items), depth), np.nan)
    for (m, i), xs in cells.items():
        samples[m_idx[m], i_idx[i], :len(xs)] = xs
    with np.errstate(all="ignore"):
        scores = np.nanmean(samples, axis=2) if depth > 1 else samples[:, :, 0]
    _check_models_present(path, models, scores)
    return ScoreMatrix(models, items, scores, samples if depth > 1 else None, source=str(path))


def _check_models_present(path, models: list[str], scores: np.ndarray) -> None:
    empty = [m for m, row in zip(models, scores) if np.isnan(row).all()]
    if empty:
        raise UsageError(f"{path}: model(s) with no scores at all: {', '.join(empty)}")


def read_lm_eval_samples(specs: Sequence[str], metric: str | None = None) -> ScoreMatrix:
    """One lm-eval-harness samples JSONL per model, given as ``NAME=path`` or ``path``."""
    if len(specs) < 2:
        raise UsageError("lm-eval samples: give one samples_*.jsonl per model, at least two models")
    per_model: dict[str, dict[str, float]] = {}
    order: list[str] = []
    for spec in specs:
        name, _, p = spec.rpartition("=") if "=" in spec else ("", "", spec)
        path = Path(p)
        name = name or path.parent.name or path.stem
        if name in per_model:
            raise UsageError(f"{path}: model name {name!r} given twice (use NAME=path to name each file)")
        if not path.is_file():
            raise UsageError(f"{path}: no such file")
        scores: dict[str, float] = {}
        used_metric = metric
        with open(path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(f"{where}: malformed JSON ({e.msg})") from None
                if not isinstance(rec, dict) or "doc_id" not in rec:
                    raise UsageError(f"{where}: missing field 'doc_id' (not an lm-eval samples line)")
                if used_metric is None:
                    found = [m for m in LM_EVAL_METRICS if m in rec]
                    if not found:
                        raise UsageError(f"{where}: no metric field ({', '.join(LM_EVAL_METRICS)}); pass --metric")
                    used_metric = found[0]
                if used_metric not in rec:
                    raise UsageError(f"{where}: missing metric field {used_metric!r}")
                iid = str(rec["doc_id"])
                if iid in scores:
                    raise UsageError(f"{where}: duplicate doc_id {iid!r}")
                value = rec[used_metric]
                if isinstance(value, list) and len(value) == 1:
                    value = value[0]
                scores[iid] = _cell(value, f"{where}: field {used_metric!r}")
        if not scores:
            raise UsageError(f"{path}: no records")
        per_model[name] = scores
        order.append(name)
    items = sorted({i for s in per_model.values() for i in s}, key=lambda s: (len(s), s))
    mat = np.full((len(order), len(items)), np.nan)
    for a, m in enumerate(order):
        for j, i in enumerate(items):
            mat[a, j] = per_model[m].get(i, math.nan)
    return ScoreMatrix(order, items, mat, source=",".join(specs))


def load_matrix(paths: Sequence[str | Path], metric: str | None = None) -> ScoreMatrix:
    """Read one table (wide/long CSV or parquet) or several lm-eval samples JSONL files."""
    paths = [str(p) for p in paths]
    if not paths:
        raise UsageError("no result file given (--responses)")
    if all(p.rpartition("=")[2].endswith(".jsonl") for p in paths):
        return read_lm_eval_samples(paths, metric)
    if len(paths) != 1:
        raise UsageError("give one wide/long table, or several lm-eval samples .jsonl files")
    path = Path(paths[0])
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    if path.suffix not in (".csv", ".parquet"):
        raise UsageError(f"{path}: unsupported format (use .csv, .parquet or lm-eval samples .jsonl)")
    return read_table_matrix(path)


def complete_items(matrix: ScoreMatrix) -> tuple[ScoreMatrix, int]:
    """Drop items with a missing score for any model; returns the matrix and the number dropped."""
    keep = ~np.isnan(matrix.scores).any(axis=0)
    dropped = int((~keep).sum())
    if keep.sum() == 0:
        raise UsageError(f"{matrix.source}: no item has a score for every model")
    if dropped == 0:
        return matrix, 0
    ids = [i for i, k in zip(matrix.item_ids, keep) if k]
    out = ScoreMatrix(matrix.models, ids, matrix.scores[:, keep],
                      None if matrix.samples is None else matrix.samples[:, keep], matrix.source,
                      matrix.notes + [f"dropped {dropped} item(s) with a missing score"])
    return out, dropped


def write_wide(matrix: ScoreMatrix, path: Path) -> None:
    """Write a wide CSV or parquet (atomic)."""
    from llmtool.core.checkpoint import atomic_file

    rows = matrix.to_rows()
    with atomic_file(Path(path)) as tmp:
        if Path(path).suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), tmp)
        else:
            with open(tmp, "w", newline="", encoding="utf-8") as fh:
                w = csv.DictWriter(fh, fieldnames=["item_id", *matrix.models])
                w.writeheader()
                for r in rows:
                    w.writerow({k: (int(v) if isinstance(v, float) and v in (0.0, 1.0) else v) for k, v in r.items()})
