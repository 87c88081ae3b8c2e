"""Helpers shared by the HTTP-process tests (imported by name: a module called `conftest` would
collide with the other test folders' conftest files in a whole-suite run).

- a real byte-level BPE tokenizer trained on standard-library sources (about a second),
- the fake engine process and the output channel it writes on (the test plays the supervisor),
- SSE and /metrics readers.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import aiohttp
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.server.output_source import open_output

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
MODEL_NAME = "tiny-test"
LONG = {"model": MODEL_NAME, "prompt": "x = [i * i for i in range(10)]\n", "max_tokens": 400, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": 1}
open_fake_output = open_output  # the server's real adapter over ipc's OutputReader


def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:40]
    return [f.read_text(errors="replace") for f in files] + ["héllo wörld ünïcödé 日本語のテキスト 🙂🚀 ✓"] * 20


def write_model_dir(path: Path, vocab_size: int = 1200) -> Path:
    """tokenizer.json + tokenizer_config.json (ChatML template) of a freshly trained tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": SPECIALS[0], "bos_token": None}))
    return path


class FakeEngineProcess:
    """The supervisor's part for a test: own the output channel, run the fake engine, clean up."""

    def __init__(self, runtime_dir: Path, vocab_size: int, *extra: str, transport: str = "posix") -> None:
        runtime_dir.mkdir(mode=0o700, exist_ok=True)
        self.instance = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.channel = OutputChannel.create(self.instance, transport)
        self.proc = subprocess.Popen([sys.executable, str(FAKE_ENGINE), str(runtime_dir), self.instance,
                                      "--vocab-size", str(vocab_size), *extra], cwd=FAKE_ENGINE.parent)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc)
        self.channel.remove()


def start_fake_engine(runtime_dir: Path, vocab_size: int, *extra: str,
                      transport: str = "posix") -> FakeEngineProcess:
    return FakeEngineProcess(runtime_dir, vocab_size, *extra, transport=transport)


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def wait_healthy(base_url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(f"{base_url}/health") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.05)
    raise TimeoutError("server never became healthy")


def gauge(text: str, name: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$', text, re.M)
    assert match, name
    return float(match.group(1))


async def metrics(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/metrics") as resp:
        return await resp.text()


async def read_events(resp: aiohttp.ClientResponse, until_tokens: int | None = None):
    """SSE events as dicts (`[DONE]` as None); stop early once `until_tokens` tokens were seen."""
    events, tokens = [], 0
    async for line in resp.content:
        if not line.strip():
            continue
        payload = line.removeprefix(b"data: ").strip()
        event = None if payload == b"[DONE]" else json.loads(payload)
        events.append(event)
        for choice in (event or {}).get("choices", []):
            tokens += len((choice.get("logprobs") or {}).get("tokens", []))
        if until_tokens is not None and tokens >= until_tokens:
            break
    return events, tokens
