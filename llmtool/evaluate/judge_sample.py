"""Sampling n thinking-judge ratings per pair, and instruction-based self-aggregation (spec judge-btd.md §2,
§3.6, §4.4).

The judge sees a prompt and two responses, is asked to reason and then to end with one line
``Final rating: <value>`` on the chosen scale:

* ``3way``: ``A`` (A better), ``tie``, ``B`` (B better) -> +1, 0, -1;
* ``5pt`` / ``7pt``: an integer in -2..2 / -3..3, positive = A better.

Parsing is strict: only the LAST ``Final rating:`` marker of the output counts, and the rest of its line
must be exactly one scale value (optionally wrapped in markdown/quote/bracket decoration and followed by a
full stop). Anything else -- no marker, junk after it, a value outside the scale -- is ``None`` (a parse
failure; never guessed). With ``--swap half`` every odd sample is shown in BA order (the canonical B in
the ``Response A`` slot); its rating is mirrored into the canonical frame (positive = canonical A better)
before it is written, so the vote file is always in the canonical frame.

Backends: ``hf:DIR|alias`` (or a bare directory/alias): in-process transformers with batched sampling
through :func:`llmtool.core.lm.generate`; ``openai:MODEL`` with ``--api-base``: any OpenAI-compatible
server through :class:`llmtool.core.endpoint.OpenAIEndpoint` (key from ``$OPENAI_API_KEY``).
``thinking_tokens`` is the number of generated tokens for local models; OpenAI-compatible replies carry
no per-choice token count, so there it is the whitespace word count of the reply.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmtool.core.console import UsageError

SCALES: dict[str, tuple[int, ...]] = {"3way": (-1, 0, 1), "5pt": tuple(range(-2, 3)), "7pt": tuple(range(-3, 4))}
SWAPS = ("none", "half", "all")
MARKER = re.compile(r"final\s+rating\s*:", re.IGNORECASE)
_DECOR = r"[\s*_`'\"<>\[\]()]*"
_VALUE_3WAY = re.compile(rf"^{_DECOR}(A|B|tie){_DECOR}\.?{_DECOR}$", re.IGNORECASE)
_VALUE_INT = re.compile(rf"^{_DECOR}([+\-\u2212]?\d+){_DECOR}\.?{_DECOR}$")

SYSTEM = "You are a careful, impartial judge of text quality."


# ------------------------------------------------------------------------------------------- pure helpers

def check_scale(scale: str) -> tuple[int, ...]:
    if scale not in SCALES:
        raise UsageError(f"--scale must be one of {', '.join(SCALES)}, got {scale!r}")
    return SCALES[scale]


def scale_instruction(scale: str) -> str:
    """How the last line must look, spelled out as the literal lines a small model can copy."""
    check_scale(scale)
    if scale == "3way":
        return ("Use A if Response A is better, B if Response B is better, tie if they are about equally good:\n"
                "Final rating: A\nFinal rating: B\nFinal rating: tie")
    k = max(SCALES[scale])
    return (f"The value is one integer from -{k} to {k}: positive if Response A is better, negative if Response B "
            f"is better, 0 if they are about equally good; a larger magnitude means a clearer difference, e.g.\n"
            f"Final rating: {k}\nFinal rating: 0\nFinal rating: -1")


def judge_prompt(prompt: str, first: str, second: str, scale: str = "3way") -> str:
    """The judge's user turn for one presented order (``first`` fills the Response A slot)."""
    return ("Compare two responses to the same prompt and decide which one is better, or whether they are about "
            "equally good.\n\n"
            f"[Prompt]\n{prompt}\n\n[Response A]\n{first}\n\n[Response B]\n{second}\n\n"
            "First explain your reasoning briefly. Then end with one line in exactly this format: "
            f"Final rating: <value>\n{scale_instruction(scale)}")


def presented(pair: dict, order: str) -> tuple[str, str]:
    """(Response A slot, Response B slot) of ``pair`` shown in ``order``."""
    if order == "AB":
        return pair["response_a"], pair["response_b"]
    if order == "BA":
        return pair["response_b"], pair["response_a"]
    raise ValueError(f"order must be AB or BA, got {order!r}")


def parse_rating(text: str, scale: str = "3way") -> int | None:
    """The rating of the LAST ``Final rating:`` line of ``text`` in the presented frame, or None when that line
    is not exactly one value of ``scale`` (or there is no such line)."""
    values = check_scale(scale)
    last = None
    for last in MARKER.finditer(text or ""):
        pass
    if last is None:
        return None
    rest = text[last.end():].split("\n", 1)[0]
    if scale == "3way":
        m = _VALUE_3WAY.match(rest)
        if not m:
            return None
        v = m.group(1)
        if v.lower() == "tie":
            return 0 if v in ("tie", "Tie", "TIE") else None
        return 1 if v == "A" else -1 if v == "B" else None   # lower-case a/b is not a scale value
    m = _VALUE_INT.match(rest)
    if not m:
        return None
    x = int(m.group(1).replace("\u2212", "-"))
    return x if x in values else None


def to_canonical(rating: int | None, order: str) -> int | None:
    """A presented-frame rating in the canonical frame (positive = canonical A better): BA votes are mirrored."""
    if order not in ("AB", "BA"):
        raise ValueError(f"order must be AB or BA, got {order!r}")
    if rating is None:
        return None
    return -rating if order == "BA" else rating


def sample_orders(n: int, swap: str) -> list[str]:
    """Presented order of samples 0..n-1: ``none`` all AB, ``all`` all BA, ``half`` odd samples BA."""
    if swap not in SWAPS:
        raise UsageError(f"--swap must be one of {', '.join(SWAPS)}, got {swap!r}")
    if swap == "none":
        return ["AB"] * n
    if swap == "all":
        return ["BA"] * n
    return ["BA" if s % 2 else "AB" for s in range(n)]


def read_pairs(rows: Sequence[dict], source: str = "pairs") -> list[dict]:
    """Validated pairs: ``id``, ``prompt``, ``response_a``, ``response_b`` (strings), optional ``task``/``group``."""
    out, seen = [], set()
    for line, r in enumerate(rows, 1):
        for f in ("id", "prompt", "response_a", "response_b"):
            if f not in r:
                raise UsageError(f"{source}:{line}: missing field {f!r}")
        for f in ("prompt", "response_a", "response_b"):
            if not isinstance(r[f], str):
                raise UsageError(f"{source}:{line}: field {f!r} must be a string")
        iid = str(r["id"])
        if iid in seen:
            raise UsageError(f"{source}:{line}: duplicate id {iid!r}")
        seen.add(iid)
        out.append({**r, "id": iid, "task": str(r.get("task", "default"))})
    if not out:
        raise UsageError(f"{source}: no pairs")
    return out


def vote_record(pair: dict, sample: int, order: str, raw: str, tokens: int, scale: str) -> dict:
    rec = {"id": pair["id"], "task": pair["task"]}
    if pair.get("group") is not None:
        rec["group"] = pair["group"]
    rec.update(sample=sample, order=order, raw=raw, rating=to_canonical(parse_rating(raw, scale), order),
               thinking_tokens=int(tokens))
    return rec


def vote_summary(votes: Sequence[dict]) -> dict:
    """Parse-failure rate and position bias of a vote file. Position bias: the share of votes for the
    response in the Response A *slot* among the valid votes shown in AB order and in BA order (an unbiased
    judge gives equal shares; a judge that always picks the first slot gives 1 and 1). None where undefined."""
    total = len(votes)
    null = sum(v["rating"] is None for v in votes)
    out = {"votes": total, "items": len({v["id"] for v in votes}), "parse_failures": null,
           "parse_failure_rate": null / total if total else None}
    for order in ("AB", "BA"):
        valid = [v for v in votes if v.get("order", "AB") == order and v["rating"] is not None]
        slot_a = sum((v["rating"] > 0) if order == "AB" else (v["rating"] < 0) for v in valid)
        ties = sum(v["rating"] == 0 for v in valid)
        out[f"valid_{order}"] = len(valid)
        out[f"first_slot_share_{order}"] = slot_a / len(valid) if valid else None
        out[f"tie_share_{order}"] = ties / len(valid) if valid else None
    return out


# ------------------------------------------------------------------------------------------- self-aggregation

def self_agg_prompt(pair: dict, outputs: Sequence[dict], scale: str = "3way", max_raw_chars: int = 1000) -> str:
    """The aggregator's user turn: the pair in canonical order and the judge's n outputs. An output made with
    the responses shown in BA order is labelled so (its 'A' is Response B here), and its rating is restated
    in the canonical frame."""
    lines = [("Several independent evaluations of the same two responses are given below. Read them and give "
              "one final verdict.\n"), f"[Prompt]\n{pair['prompt']}\n", f"[Response A]\n{pair['response_a']}\n",
             f"[Response B]\n{pair['response_b']}\n"]
    for k, o in enumerate(outputs, 1):
        raw = (o.get("raw") or "").strip()
        if len(raw) > max_raw_chars:
            raw = raw[:max_raw_chars] + " [...]"
        if o.get("order", "AB") == "BA":
            head = (f"[Evaluation {k}] (this evaluator saw the responses in swapped order: its 'A' is Response B "
                    "above and its 'B' is Response A)")
        else:
            head = f"[Evaluation {k}]"
        r = o.get("rating")
        restated = "unreadable" if r is None else format_rating(r, scale)
        lines.append(f"{head}\n{raw}\n(rating in the order above: {restated})\n")
    lines.append("Weigh the evaluations, explain briefly, then end with one line in exactly this format: "
                 f"Final rating: <value>\n{scale_instruction(scale)}")
    return "\n".join(lines)


def format_rating(rating: float, scale: str = "3way") -> str:
    if scale == "3way":
        return "A" if rating > 0 else "B" if rating < 0 else "tie"
    return f"{int(rating):+d}" if rating else "0"


# ------------------------------------------------------------------------------------------- backends

@dataclass
class Generation:
    text: str
    tokens: int


# prompt list, samples per prompt -> per prompt a list of generations
Generator = Callable[[Sequence[str], int], list[list[Generation]]]


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``hf:DIR|alias`` / ``openai:MODEL`` / bare DIR|alias -> (kind, arg)."""
    kind, sep, arg = spec.partition(":")
    if sep and kind in ("hf", "openai"):
        if not arg:
            raise UsageError(f"--judge {spec!r}: nothing after {kind}:")
        return kind, arg
    return "hf", spec


def _cache_kwarg(model) -> str:
    """The KV-cache keyword of this transformers version (``cache`` in 5.x, ``past_key_values`` before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _out_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


class _ChunkDecoder:
    """The decode state of one chunk of prompts x k samples: a KV cache, an attention mask over everything fed
    so far (0 for left padding and for rows that stopped), per-row token lists."""

    def __init__(self, model, tok, chunk: list[list[int]], k: int, pick):
        import torch

        self.torch, self.model, self.tok, self.pick = torch, model, tok, pick
        self.dev = next(model.parameters()).device
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.eos = tok.eos_token_id
        self.kw = _cache_kwarg(model)
        import inspect

        # only the last position's logits are needed (the full [B, T, vocab] tensor would cost as much as the model)
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        width = max(max(len(e) for e in chunk), 1)
        ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, e in enumerate(chunk):
            if e:
                ids[i, width - len(e):] = torch.tensor(e)
                mask[i, width - len(e):] = 1
        with torch.no_grad():
            out = model(input_ids=ids.to(self.dev), attention_mask=mask.to(self.dev),
                        position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(self.dev), use_cache=True, **self.keep)
        self.cache, self.logits = _out_cache(out), out.logits[:, -1]
        if k > 1:  # one prefill per prompt, its cache repeated for the k samples
            self.cache.batch_repeat_interleave(k)
            self.logits, mask = self.logits.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)
        self.mask = mask
        self.rows = mask.shape[0]

    def feed(self, block, block_mask) -> None:
        torch = self.torch
        self.mask = torch.cat([self.mask, block_mask], 1)
        pos = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -block.shape[1]:]
        with torch.no_grad():
            o = self.model(input_ids=block.to(self.dev), attention_mask=self.mask.to(self.dev),
                           position_ids=pos.to(self.dev), use_cache=True, **{self.kw: self.cache}, **self.keep)
        self.cache, self.logits = _out_cache(o), o.logits[:, -1]

    def phase(self, active: list[bool], budget: int, toks: list[list[int]], stop) -> list[int | None]:
        """Sample up to ``budget`` tokens into ``toks`` for the active rows (a row ends at EOS or when
        ``stop(row, token)``); returns each row's last sampled token that was not fed yet."""
        torch = self.torch
        pending: list[int | None] = [None] * self.rows
        for t in range(budget):
            if not any(active):
                break
            nxt = self.pick(self.logits).tolist()
            block = torch.full((self.rows, 1), self.pad, dtype=torch.long)
            bmask = torch.zeros((self.rows, 1), dtype=torch.long)
            for r in range(self.rows):
                if not active[r]:
                    continue
                if self.eos is not None and nxt[r] == self.eos:
                    active[r] = False
                    continue
                toks[r].append(nxt[r])
                if stop(r, nxt[r]):
                    active[r] = False
                    continue
                block[r, 0], bmask[r, 0] = nxt[r], 1
            if t == budget - 1 or not any(active):
                pending = [int(block[r, 0]) if bmask[r, 0] else None for r in range(self.rows)]
                break
            self.feed(block, bmask)
        return pending


def hf_sample(model, tok, texts: Sequence[str], k: int, *, temperature: float = 1.0, max_new_tokens: int = 256,
              force_final: bool = False, value_tokens: int = 4, batch_rows: int = 32, seed: int = 0,
              desc: str | None = None) -> list[list[Generation]]:
    """``k`` samples of each prompt text, with one prefill per prompt (its KV cache repeated ``k`` times) and a
    batched decode loop. A sample stops at EOS, at the end of its first complete ``Final rating:`` line, or after
    ``max_new_tokens``. With ``force_final`` (budget forcing, as in s1), a sample whose text has no
    ``Final rating:`` marker at all when it stops gets the marker appended (teacher-forced) and up to
    ``value_tokens`` more sampled tokens, ending at the first newline; the same strict parser reads the result.
    ``temperature == 0`` is greedy. ``tokens`` counts the freely generated (thinking) tokens only."""
    import torch

    from llmtool.core.console import progress
    from llmtool.core.data import prompt_ids

    if k < 1:
        raise ValueError("k must be >= 1")
    marker = tok("\nFinal rating:", add_special_tokens=False)["input_ids"]
    enc = [prompt_ids(tok, t) for t in texts]      # BOS first where the tokenizer starts texts with one
    gen = torch.Generator().manual_seed(seed)

    def pick(logits):
        if temperature <= 0:
            return logits.argmax(-1).cpu()
        probs = torch.softmax(logits.float() / temperature, -1).cpu()
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    def has_newline(token: int) -> bool:
        return "\n" in tok.decode([token])

    per = max(1, batch_rows // k)
    starts = range(0, len(enc), per)
    results: list[list[Generation]] = []
    for s in (progress(starts, desc, total=len(starts)) if desc else starts):
        d = _ChunkDecoder(model, tok, enc[s:s + per], k, pick)
        think: list[list[int]] = [[] for _ in range(d.rows)]

        def final_line_done(r: int, token: int, think=think) -> bool:
            if not has_newline(token):
                return False
            text = tok.decode(think[r], skip_special_tokens=True)
            m = MARKER.search(text)
            return m is not None and "\n" in text[m.end():]

        pending = d.phase([True] * d.rows, max_new_tokens, think, final_line_done)
        forced = [force_final and not MARKER.search(tok.decode(t, skip_special_tokens=True)) for t in think]
        value: list[list[int]] = [[] for _ in range(d.rows)]
        if any(forced):
            block = torch.full((d.rows, 1 + len(marker)), d.pad, dtype=torch.long)
            bmask = torch.zeros_like(block)
            for r in range(d.rows):
                if forced[r]:
                    if pending[r] is not None:
                        block[r, 0], bmask[r, 0] = pending[r], 1
                    block[r, 1:], bmask[r, 1:] = torch.tensor(marker), 1
            d.feed(block, bmask)
            d.phase(list(forced), value_tokens, value, lambda r, token: has_newline(token))
        for i in range(0, d.rows, k):
            results.append([Generation(tok.decode(think[r] + (marker + value[r] if forced[r] else []),
                                                  skip_special_tokens=True), len(think[r])) for r in range(i, i + k)])
    return results


def hf_generator(model, tok, *, temperature: float, max_new_tokens: int, batch_rows: int = 32, seed: int = 0,
                 force_final: bool = False, value_tokens: int = 4, desc: str | None = None) -> Generator:
    """Batched local sampling (chat template when the tokenizer has one); see :func:`hf_sample`."""
    from llmtool.core.lm import chat_prompt

    calls = [0]

    def gen(prompts: Sequence[str], n: int) -> list[list[Generation]]:
        texts = [chat_prompt(tok, p, SYSTEM) for p in prompts]
        out = hf_sample(model, tok, texts, n, temperature=temperature, max_new_tokens=max_new_tokens,
                        force_final=force_final, value_tokens=value_tokens, batch_rows=batch_rows,
                        seed=seed + 7919 * calls[0], desc=desc)
        calls[0] += 1
        return out

    return gen


def openai_generator(model: str, api_base: str, *, temperature: float, max_new_tokens: int, seed: int,
                     concurrency: int = 4, timeout: float = 600.0, desc: str | None = None) -> Generator:
    from concurrent.futures import ThreadPoolExecutor

    from llmtool.core.console import progress
    from llmtool.core.endpoint import OpenAIEndpoint

    ep = OpenAIEndpoint(api_base, model, timeout=timeout)

    def one(args) -> list[Generation]:
        i, p, n = args
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}]
        got = ep.chat(msgs, n=n, temperature=temperature, max_tokens=max_new_tokens, seed=seed + i)
        texts = [str(m.get("content") or "") for m in got]  # n of them: chat() tops up servers that ignore n
        return [Generation(t, len(t.split())) for t in texts]

    def gen(prompts: Sequence[str], n: int) -> list[list[Generation]]:
        jobs = [(i, p, n) for i, p in enumerate(prompts)]
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            it = pool.map(one, jobs)
            return list(progress(it, desc, total=len(jobs)) if desc else it)

    return gen


# ------------------------------------------------------------------------------------------- drivers

def sample_votes(pairs: Sequence[dict], gen: Generator, n: int, swap: str = "half", scale: str = "3way") -> list[dict]:
    """``n`` votes per pair (sample s shown in ``sample_orders(n, swap)[s]``), in the canonical frame."""
    check_scale(scale)
    if n < 1:
        raise UsageError(f"--n must be >= 1, got {n}")
    orders = sample_orders(n, swap)
    per_order: dict[str, list[list[Generation]]] = {}
    for order in ("AB", "BA"):
        k = orders.count(order)
        if k:
            prompts = [judge_prompt(p["prompt"], *presented(p, order), scale) for p in pairs]
            per_order[order] = gen(prompts, k)
    votes = []
    for i, pair in enumerate(pairs):
        used = {"AB": 0, "BA": 0}
        for s, order in enumerate(orders):
            g = per_order[order][i][used[order]]
            used[order] += 1
            votes.append(vote_record(pair, s, order, g.text, g.tokens, scale))
    return votes


def group_votes(votes: Sequence[dict], source: str = "votes") -> dict[str, list[dict]]:
    per: dict[str, list[dict]] = {}
    for line, v in enumerate(votes, 1):
        if "id" not in v:
            raise UsageError(f"{source}:{line}: missing field 'id'")
        r = v.get("rating")
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)):
            raise UsageError(f"{source}:{line}: field 'rating' must be a number or null, got {r!r}")
        per.setdefault(str(v["id"]), []).append(v)
    for rows in per.values():
        rows.sort(key=lambda v: v.get("sample", 0))
    return per


def self_aggregate(pairs: Sequence[dict], votes: Sequence[dict], gen: Generator, scale: str = "3way",
                   max_raw_chars: int = 1000, source: str = "votes") -> list[dict]:
    """One aggregated rating per pair that has votes: ``{id, task, method, rating, parsed, raw, n_outputs}``;
    an unparseable answer is ``rating: null`` here (the judge report counts it as a tie and a failure)."""
    per = group_votes(votes, source)
    todo = [p for p in pairs if p["id"] in per]
    if not todo:
        raise UsageError(f"{source}: no votes for any pair id")
    prompts = [self_agg_prompt(p, per[p["id"]], scale, max_raw_chars) for p in todo]
    outs = gen(prompts, 1)
    recs = []
    for p, o in zip(todo, outs):
        g = o[0]
        r = parse_rating(g.text, scale)   # the pair is shown in canonical order: no mirroring
        rec = {"id": p["id"], "task": p["task"], "method": "self-agg", "rating": r, "parsed": r is not None,
               "raw": g.text, "n_outputs": len(per[p["id"]]), "tokens": g.tokens}
        if p.get("group") is not None:
            rec["group"] = p["group"]
        recs.append(rec)
    return recs
