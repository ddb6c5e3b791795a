"""Agent backends (pipe-interface.md §5): ``script:oracle|random``, ``hf:DIR|alias`` and
``openai:URL#MODEL``. An agent maps a message list (OpenAI roles) to a :class:`Turn`.

``hf:``: the chat template renders the messages; the KV cache of the previous call is reused for the
longest common token prefix (``DynamicCache.crop``), so a multi-turn episode only encodes the new turn;
greedy by default, stop strings, per-token entropy of the output distribution (UltraHorizon's locking
analysis). A template without a ``tool`` role gets tool results as ``user`` turns (the harness already
sends observations as ``user`` turns). ``openai:``: :class:`llmtool.core.endpoint.OpenAIEndpoint`
(retries with backoff); text protocol by default, ``tools`` protocol sends schemas and converts
``tool_calls`` back to text, falling back to text when the server answers 400 for tools.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

from llmtool.core.console import UsageError
from llmtool.core.registry import Registry

AGENTS: Registry = Registry("bench-agent run", "agent scheme")


class ContextOverflow(Exception):
    """The prompt no longer fits the model's context window (the ``full`` policy's failure mode)."""


@dataclass
class Turn:
    content: str
    usage: dict = field(default_factory=lambda: {"prompt": 0, "completion": 0})
    entropy: float | None = None
    tool_calls: list = field(default_factory=list)
    seconds: float = 0.0


class Agent:
    uri: str = ""
    concurrent: bool = False   # safe to call from several threads

    def act(self, messages: list[dict], ctx=None) -> Turn:
        raise NotImplementedError

    def reset(self) -> None:
        pass


def _n_tokens(messages) -> int:
    return sum(len(str(m.get("content", ""))) for m in messages) // 4 + 1


def tools_prompt(schemas: list[dict]) -> str:
    """Tool schemas written into the prompt (for templates without tool support)."""
    return ("You can call these tools:\n" + "\n".join(json.dumps(t["function"]) for t in schemas) +
            '\nCall exactly one tool per reply as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.')


def listed_names(system: str) -> list[list[str]]:
    """The action names announced in a (rewritten) system prompt: one list per identifier, in listing
    order, from the ``- name[ or name]: doc`` lines that follow the ``Actions`` header."""
    out, on = [], False
    for line in system.splitlines():
        if line.startswith("Actions"):
            on = True
            continue
        if on:
            if not line.startswith("- "):
                break
            head = line[2:].split(":", 1)[0]
            out.append([n.strip() for n in head.split(" or ") if n.strip()])
    return out


@AGENTS.register("script")
class ScriptAgent(Agent):
    """``script:oracle``: asks the environment for its optimal action and writes it with the name it
    READS from the (rewritten) system prompt — the first name listed for that identifier — so it only
    succeeds when the display side announces names that the translation layer accepts.
    ``script:random``: a uniformly random listed name with a random argument (seeded)."""

    concurrent = True

    def __init__(self, spec: str, seed: int = 0, **_):
        if spec not in ("oracle", "random"):
            raise UsageError(f"--model script:{spec}: scripted agents are script:oracle and script:random")
        self.kind, self.rng, self.uri = spec, random.Random(seed), f"script:{spec}"

    def act(self, messages, ctx=None) -> Turn:
        if ctx is None:
            raise ValueError("scripted agents need the episode context")
        listed = listed_names(messages[0]["content"] if messages and messages[0]["role"] == "system" else "")
        if len(listed) != len(ctx.env.IDENTIFIERS):
            text = "I cannot find the action list."
        elif self.kind == "oracle":
            ident, arg = ctx.env.oracle_action()
            name = listed[ctx.env.IDENTIFIERS.index(ident)][0]
            text = f"Action: {name}" + (f" {arg}" if arg else "")
        else:
            name = self.rng.choice(self.rng.choice(listed))
            arg = self.rng.choice(["", "1", "north", "coin", "/data"])
            text = f"Action: {name}" + (f" {arg}" if arg else "")
        return Turn(text, {"prompt": _n_tokens(messages), "completion": len(text) // 4 + 1})


def render_prompt(tok, messages) -> str:
    """The text an ``hf:`` agent is prompted with: the chat template with the generation prompt, or, for a
    tokenizer without one (base models such as Gemma 3 270M), ``role: content`` lines ending in
    ``assistant:``. SFT examples for an agent are rendered here too, so training and evaluation agree."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@AGENTS.register("hf")
class HFAgent(Agent):
    """In-process transformers agent. ``protocol="tools"`` writes the JSON tool schemas into the system
    prompt and asks for ``<tool_call>{...}</tool_call>`` (small models' chat templates, SmolLM2's
    included, ignore ``tools=``); the harness's tolerant parser reads any of the four call formats."""

    def __init__(self, spec: str, max_new_tokens: int = 64, temperature: float = 0.0, stop=("\n\n",),
                 seed: int = 0, model=None, tokenizer=None, protocol: str = "text", **_):
        from llmtool.core.console import OPTIONS
        from llmtool.core.models import load_model, load_tokenizer

        self.uri = f"hf:{spec}"
        self.model = model if model is not None else load_model(spec, dtype=OPTIONS.dtype, device=OPTIONS.device)
        self.tok = tokenizer if tokenizer is not None else load_tokenizer(spec)
        self.model.eval()
        self.max_new_tokens, self.temperature, self.stop = max_new_tokens, temperature, tuple(stop)
        self.seed, self.protocol = seed, protocol
        self.max_context = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        import inspect

        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"   # transformers >= 5.2x: cache
        # only the last position's logits are used: at a 49k vocabulary the head over a 1,000-token prefill
        # costs about a quarter of the prefill, for logits that are thrown away
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._fed: list[int] = []
        self._cache = None
        self.reused_tokens = 0

    def render(self, messages) -> list[int]:
        """The prompt's token ids: :func:`render_prompt`'s text, led by BOS where the tokenizer starts every
        text with one (``core.data.prompt_ids``; Gemma 3 270M without its BOS is another model)."""
        from llmtool.core.data import prompt_ids

        return prompt_ids(self.tok, render_prompt(self.tok, messages))

    def reset(self) -> None:
        self._fed, self._cache = [], None

    def act(self, messages, ctx=None) -> Turn:
        import torch
        from transformers import DynamicCache

        t0 = time.time()
        if self.protocol == "tools" and ctx is not None and messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": messages[0]["content"] + "\n" + tools_prompt(ctx.tool_schemas())},
                        *messages[1:]]
        ids = self.render(messages)
        if self.max_context and len(ids) + self.max_new_tokens > self.max_context:
            raise ContextOverflow(f"prompt of {len(ids)} tokens + {self.max_new_tokens} new > {self.max_context}")
        dev = next(self.model.parameters()).device
        common = 0
        for a, b in zip(self._fed, ids[:-1]):
            if a != b:
                break
            common += 1
        if self._cache is not None and common > 0:
            extra = self._cache.get_seq_length() - common
            if extra > 0:
                self._cache.crop(-extra)    # transformers 5: a negative count of tokens to drop
        else:
            self._cache, common = DynamicCache(), 0
        self.reused_tokens += common
        self._fed = list(ids[:common])
        gen = torch.Generator().manual_seed(self.seed + len(ids))
        feed = ids[common:]
        out: list[int] = []
        ents = []
        eos = self.tok.eos_token_id
        text = ""
        with torch.no_grad():
            for _ in range(self.max_new_tokens):
                x = torch.tensor([feed], device=dev)
                kw = {self._cache_kw: self._cache, **self._last_only}
                logits = self.model(input_ids=x, use_cache=True, **kw).logits[0, -1].float()
                self._fed.extend(feed)
                logp = torch.log_softmax(logits, -1)
                ents.append(float(-(logp.exp() * logp).sum()))
                if self.temperature > 0:
                    probs = torch.softmax(logits / self.temperature, -1).cpu()
                    nxt = int(torch.multinomial(probs, 1, generator=gen))
                else:
                    nxt = int(logits.argmax())
                if nxt == eos:
                    break
                out.append(nxt)
                feed = [nxt]
                text = self.tok.decode(out, skip_special_tokens=True)
                if any(s in text for s in self.stop):
                    break
        for s in self.stop:
            if s in text:
                text = text[:text.index(s)]
        return Turn(text.strip(), {"prompt": len(ids), "completion": len(out) + 1},
                    sum(ents) / len(ents) if ents else None, seconds=time.time() - t0)


    def act_batch(self, batch: list[list[dict]]) -> list[Turn]:
        """Many conversations at once (no cache reuse): one left-padded ``llmtool.core.lm.generate`` call."""
        from llmtool.core.lm import generate

        t0 = time.time()
        prompts = [self.render(m) for m in batch]
        outs = generate(self.model, self.tok, prompts, max_new_tokens=self.max_new_tokens,
                        temperature=self.temperature, stop=self.stop, seed=self.seed, batch_size=len(prompts))
        dt = (time.time() - t0) / max(1, len(batch))
        return [Turn(o[0].text.strip(), {"prompt": len(p), "completion": len(o[0].token_ids)}, seconds=dt)
                for p, o in zip(prompts, outs)]


@AGENTS.register("openai")
class OpenAIAgent(Agent):
    """``openai:URL#MODEL``; key from ``LLMTOOL_API_KEY`` (else ``OPENAI_API_KEY``)."""

    concurrent = True

    def __init__(self, spec: str, max_new_tokens: int = 256, temperature: float = 0.0, protocol: str = "text",
                 seed: int = 0, retries: int = 4, backoff: float = 1.0, timeout: float = 300.0, **_):
        import os

        from llmtool.core.endpoint import OpenAIEndpoint

        if "#" not in spec:
            raise UsageError(f"--model openai:{spec}: write openai:URL#MODEL, e.g. openai:http://127.0.0.1:8000/v1#qwen")
        url, model = spec.split("#", 1)
        key = os.environ.get("LLMTOOL_API_KEY")
        self.ep = OpenAIEndpoint(url, model, api_key=key, retries=retries, backoff=backoff, timeout=timeout)
        self.uri, self.max_new_tokens, self.temperature = f"openai:{spec}", max_new_tokens, temperature
        self.protocol, self.seed = protocol, seed

    def check(self) -> None:
        """Fail early (one line, exit 2) when the server is unreachable or does not serve the model."""
        ids = self.ep.check()
        if ids and self.ep.model not in ids:
            from llmtool.core.console import info

            info(f"warning: {self.ep.api_base} lists {', '.join(ids[:5])}, not {self.ep.model!r}")

    def act(self, messages, ctx=None, tools=None) -> Turn:
        t0 = time.time()
        payload = {"model": self.ep.model, "messages": list(messages), "temperature": self.temperature,
                   "max_tokens": self.max_new_tokens, "seed": self.seed}
        if tools is None and self.protocol == "tools" and ctx is not None:
            tools = ctx.tool_schemas()
        if tools:
            payload["tools"] = tools
            payload["tool_choice"] = "auto"
        try:
            got = self.ep._request("chat/completions", payload)
        except UsageError as e:
            if tools and "HTTP 400" in str(e):
                if self.protocol == "tools":
                    from llmtool.core.console import info

                    info(f"warning: {self.ep.api_base} refused tool calling ({str(e)[:120]}); using the text protocol")
                self.protocol = "text"          # server refuses tools: fall back to the text protocol
                payload.pop("tools")
                payload.pop("tool_choice")
                got = self.ep._request("chat/completions", payload)
            else:
                raise
        try:
            msg = got["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise UsageError(f"{self.ep.api_base}: unexpected reply (no choices[0].message)") from None
        usage = got.get("usage") or {}
        content = msg.get("content") or ""
        calls = []
        for c in msg.get("tool_calls") or []:
            fn = c.get("function", {})
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                args = {"_raw": args}
            calls.append({"id": c.get("id"), "name": fn.get("name", ""), "arguments": args})
        if calls and not content.strip():
            first = calls[0]
            arg = " ".join(str(v) for v in first["arguments"].values())
            content = f"Action: {first['name']}" + (f" {arg}" if arg else "")
        return Turn(content, {"prompt": int(usage.get("prompt_tokens", 0)),
                              "completion": int(usage.get("completion_tokens", 0))},
                    tool_calls=calls, seconds=time.time() - t0)


def make_agent(uri: str, **options) -> Agent:
    if ":" not in uri:
        raise UsageError(f"--model {uri!r}: write hf:DIR_OR_ALIAS, openai:URL#MODEL or script:oracle")
    scheme, spec = uri.split(":", 1)
    return AGENTS.get(scheme)(spec, **options)
