"""Shared fixtures: a real byte-level BPE tokenizer trained on standard-library sources (a second or
so), a model directory around it, and a fixture that fails a test when something blocks the loop."""

from __future__ import annotations

import asyncio
import json
import sysconfig
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtpserve.server.text_model import TextModel

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:40]
    return [f.read_text(errors="replace") for f in files] + ["héllo wörld ünïcödé 日本語のテキスト 🙂🚀 ✓"] * 20


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    path = tmp_path_factory.mktemp("model")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": SPECIALS[0], "bos_token": None}))
    return path


@pytest.fixture(scope="session")
def text_model(model_dir) -> TextModel:
    return TextModel.from_dir(model_dir)


@pytest.fixture
async def no_loop_blocking():
    """Fail the test if any single callback holds the event loop for more than 0.25 s."""
    loop = asyncio.get_running_loop()
    worst = [0.0]
    stop = False

    async def watch() -> None:
        while not stop:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            worst[0] = max(worst[0], time.monotonic() - before - 0.01)

    task = loop.create_task(watch())
    yield
    stop = True
    await task
    assert worst[0] < 0.25, f"event loop blocked for {worst[0]:.3f}s"
