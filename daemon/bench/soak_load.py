"""The soak's mixed load: what each request sends, and what it checks on the answer.

Streams with logprobs are counted token by token: one logprob entry per token the usage counts, and
exactly max_tokens of them (ignore_eos), so a lost or duplicated token shows. Greedy texts are compared
with the reference the instance gave before the load; a difference is reported as a divergence, not a
loss, since a batch's summation order can flip a near-tie (tests/engine/test_model_runner.py). The others
check their shape: n choices, a stop string never in the text, a seeded sample repeating itself.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n", "for i in range(", "    return self.",
           "with open(path) as f:", "# parse the arguments\n", "if __name__ == '__main__':"]
MAX_TOKENS = 32


@dataclass
class Outcome:
    kind: str
    started: float  # monotonic
    status: int  # HTTP status; 0 when the connection failed
    cut: str = ""  # why a stream ended early: "client" (our own disconnect), "error event", ...
    checked: bool = False  # the tokens were checked against the reference
    lost: int = 0  # tokens missing (or a malformed answer: a wrong choice count, a stop string shown)
    duplicated: int = 0  # tokens delivered twice
    diverged: bool = False  # a greedy text differs from the reference


@dataclass
class Load:
    url: str
    model: str
    references: dict[str, str] = field(default_factory=dict)  # greedy text per prompt
    seeded: dict[str, str] = field(default_factory=dict)  # a seeded sample per prompt, once seen
    outcomes: list[Outcome] = field(default_factory=list)

    async def prepare(self, session: aiohttp.ClientSession) -> None:
        for prompt in PROMPTS:
            body = self._body(prompt, stream=False)
            async with session.post(self.url + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                self.references[prompt] = (await resp.json())["choices"][0]["text"]

    async def one(self, session: aiohttp.ClientSession, rng: random.Random) -> Outcome:
        kind = rng.choice(("stream_greedy", "greedy", "stream_logprobs", "chat_seeded", "n2_sampled",
                           "stop_string", "disconnect"))
        prompt = rng.choice(PROMPTS)
        outcome = Outcome(kind, time.monotonic(), 0)
        try:
            await getattr(self, "_" + kind)(session, prompt, outcome, rng)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome.cut = outcome.cut or f"connection: {type(exc).__name__}"
        self.outcomes.append(outcome)
        return outcome

    def _body(self, prompt: str, stream: bool, **extra: object) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": stream, **extra}

    async def _greedy(self, session, prompt, outcome, rng) -> None:
        async with session.post(self.url + "/v1/completions", json=self._body(prompt, False)) as resp:
            outcome.status = resp.status
            if resp.status == 200:
                self._check(outcome, prompt, (await resp.json())["choices"][0]["text"])

    async def _stream_greedy(self, session, prompt, outcome, rng) -> None:
        chunks, _ = await self._stream(session, self._body(prompt, True), outcome)
        if outcome.status == 200 and not outcome.cut:
            self._check(outcome, prompt, "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")))

    async def _stream_logprobs(self, session, prompt, outcome, rng) -> None:
        body = self._body(prompt, True, logprobs=rng.randint(0, 5), stream_options={"include_usage": True})
        chunks, usage = await self._stream(session, body, outcome)
        if outcome.status != 200 or outcome.cut:
            return
        self._check(outcome, prompt, "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")))
        entries = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c.get("choices"))
        outcome.lost += max(MAX_TOKENS - entries, 0) + max(MAX_TOKENS - usage.get("completion_tokens", 0), 0)
        outcome.duplicated += max(entries - MAX_TOKENS, 0)

    async def _chat_seeded(self, session, prompt, outcome, rng) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                "temperature": 0.8, "seed": 7, "stream": True}
        chunks, _ = await self._stream(session, body, outcome, path="/v1/chat/completions")
        if outcome.status == 200 and not outcome.cut:
            text = "".join((c["choices"][0].get("delta") or {}).get("content") or ""
                           for c in chunks if c.get("choices"))
            seen = self.seeded.setdefault(prompt, text)
            outcome.checked, outcome.diverged = True, seen != text  # a seed repeats its sample

    async def _n2_sampled(self, session, prompt, outcome, rng) -> None:
        body = {**self._body(prompt, False), "n": 2, "temperature": 1.0}
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            outcome.status = resp.status
            if resp.status == 200:
                outcome.lost = int(len((await resp.json())["choices"]) != 2)

    async def _stop_string(self, session, prompt, outcome, rng) -> None:
        body = {**self._body(prompt, False), "stop": ["\n"], "ignore_eos": False}
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            outcome.status = resp.status
            if resp.status == 200:
                outcome.lost = int("\n" in (await resp.json())["choices"][0]["text"])

    async def _disconnect(self, session, prompt, outcome, rng) -> None:
        async with session.post(self.url + "/v1/completions", json=self._body(prompt, True)) as resp:
            outcome.status = resp.status
            seen = 0
            async for line in resp.content:
                seen += line.startswith(b"data:")
                if seen >= 3:
                    outcome.cut = "client"  # we hang up mid-stream, on purpose
                    return

    async def _stream(self, session, body, outcome, path="/v1/completions") -> tuple[list[dict], dict]:
        chunks: list[dict] = []
        usage: dict = {}
        async with session.post(self.url + path, json=body) as resp:
            outcome.status = resp.status
            if resp.status != 200:
                return chunks, usage
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    outcome.cut = "error event"
                    return chunks, usage
                usage = event.get("usage") or usage
                chunks.append(event)
        return chunks, usage

    def _check(self, outcome: Outcome, prompt: str, text: str) -> None:
        outcome.checked = True
        outcome.diverged = text != self.references[prompt]
