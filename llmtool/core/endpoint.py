"""A client for OpenAI-compatible chat endpoints (a vLLM or llama.cpp server, or a hosted API).

Used wherever an area lets a user put a large model behind a server instead of loading it in-process
(program proposers, agents, judges, rollouts). Standard library only (``urllib``): the request is one
JSON POST, and the official SDK would add a dependency for no extra capability here.

Retries: connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff
(``backoff * 2**attempt`` seconds); other HTTP errors are raised at once as :class:`UsageError`
with the server's message. The API key comes from ``api_key`` or ``$OPENAI_API_KEY`` (optional for
local servers).

``n``: vLLM answers ``n`` choices in one reply; ``transformers serve`` and llama.cpp's server ignore ``n``
and answer one, so :meth:`OpenAIEndpoint.chat` asks again, one choice at a time (seed ``seed + 100003*j``
for the j-th extra request), until it holds ``n``: every caller (GRPO rollout groups, judge samples) gets
the number of choices it asked for from any server. Tested against a real ``transformers serve`` process in
``tests/test_endpoints_real.py`` (slow).
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from llmtool.core.console import UsageError


class OpenAIEndpoint:
    def __init__(self, api_base: str, model: str, api_key: str | None = None, timeout: float = 60.0,
                 retries: int = 4, backoff: float = 1.0):
        if not api_base.startswith(("http://", "https://")):
            raise UsageError(f"--api-base {api_base!r}: must be an http(s):// URL, e.g. http://localhost:8000/v1")
        self.api_base = api_base.rstrip("/")
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff

    def _request(self, path: str, payload: dict | None = None) -> dict:
        url = f"{self.api_base}/{path.lstrip('/')}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read().decode("utf-8"))
            except urllib.error.HTTPError as e:
                body = e.read().decode("utf-8", "replace")[:300]
                if e.code == 429 or e.code >= 500:
                    last = f"HTTP {e.code}: {body}"
                else:
                    raise UsageError(f"{url}: HTTP {e.code} ({body.strip() or e.reason})") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = str(getattr(e, "reason", e))
            except json.JSONDecodeError:
                raise UsageError(f"{url}: the server did not answer with JSON") from None
            if attempt < self.retries:
                time.sleep(self.backoff * 2**attempt)
        raise UsageError(f"cannot reach {url}: {last} (after {self.retries + 1} tries)")

    def check(self) -> list[str]:
        """The server's model ids (``GET /models``); a clear error when it is unreachable."""
        saved, self.retries = self.retries, 0
        try:
            got = self._request("models")
        finally:
            self.retries = saved
        return [m.get("id", "") for m in got.get("data", [])]

    def chat(self, messages: Sequence[dict], *, n: int = 1, temperature: float = 1.0, max_tokens: int = 256,
             tools: Sequence[dict] | None = None, stop: Sequence[str] | None = None, seed: int | None = None,
             **extra: Any) -> list[dict]:
        """The ``message`` dict of each of the ``n`` choices (``content`` and possibly ``tool_calls``)."""
        payload: dict[str, Any] = {"model": self.model, "messages": list(messages), "n": n,
                                   "temperature": temperature, "max_tokens": max_tokens, **extra}
        if tools:
            payload["tools"] = list(tools)
        if stop:
            payload["stop"] = list(stop)
        if seed is not None:
            payload["seed"] = seed
        out = self._messages(self._request("chat/completions", payload))
        # Servers that ignore ``n`` (``transformers serve``, llama.cpp's server) answer one choice: ask again for
        # the rest, one at a time, each with its own seed so that seeded sampling does not repeat an answer.
        extra_no = 0
        while len(out) < n:
            extra_no += 1
            more = dict(payload, n=1)
            if seed is not None:
                more["seed"] = seed + 100003 * extra_no
            got = self._messages(self._request("chat/completions", more))
            if not got:
                raise UsageError(f"{self.api_base}: unexpected reply (no choices)")
            out += got
        return out[:n]

    def _messages(self, got: dict) -> list[dict]:
        try:
            return [c["message"] for c in got["choices"]]
        except (KeyError, TypeError):
            raise UsageError(f"{self.api_base}: unexpected reply (no choices[].message)") from None

    def usage_of(self, reply: dict) -> dict:  # pragma: no cover - convenience
        return reply.get("usage", {})
