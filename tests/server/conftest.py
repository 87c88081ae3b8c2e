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
    """Fail the test if a loop iteration holds the event loop for more than 0.25 s of CPU.

    NOTE: the loop thread's CPU time, not wall time, so that being descheduled on a busy 2-core host
    is not mistaken for blocking; a blocking sleep or syscall shows as a wall-time stall (> 1 s).
    """
    loop = asyncio.get_running_loop()
    worst_cpu, worst_wall = [0.0], [0.0]
    stop = False

    async def watch() -> None:
        while not stop:
            wall, cpu = time.monotonic(), time.thread_time()
            await asyncio.sleep(0.01)
            wall = time.monotonic() - wall - 0.01
            worst_cpu[0] = max(worst_cpu[0], min(wall, time.thread_time() - cpu))
            worst_wall[0] = max(worst_wall[0], wall)

    task = loop.create_task(watch())
    yield
    stop = True
    await task
    assert worst_cpu[0] < 0.25, f"event loop busy for {worst_cpu[0]:.3f}s of CPU in one iteration"
    assert worst_wall[0] < 1.0, f"event loop stalled for {worst_wall[0]:.3f}s"


# --- an HTTP app against the fake engine process -------------------------------------------------

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import aiohttp  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402

import uuid  # noqa: E402

from mtpserve.ipc.output_channel import OutputChannel  # noqa: E402
from mtpserve.server.app import make_app  # noqa: E402
from mtpserve.server.output_source import open_output  # noqa: E402
from mtpserve.server.context import HttpSettings  # noqa: E402

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
MODEL_NAME = "tiny-test"


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


def start_fake_engine(runtime_dir: Path, vocab_size: int, *extra: str, transport: str = "posix") -> FakeEngineProcess:
    return FakeEngineProcess(runtime_dir, vocab_size, *extra, transport=transport)


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


open_fake_output = open_output  # the server's real adapter over ipc's OutputReader


async def wait_healthy(base_url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(f"{base_url}/health") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.05)
    raise TimeoutError("server never became healthy")


@pytest.fixture
def engine_args() -> list[str]:
    return []


@pytest.fixture(params=["posix"])
def transport(request) -> str:
    """Output-channel transport of the fake engine; modules override it to run both."""
    return request.param


@pytest.fixture
def settings() -> HttpSettings:
    return HttpSettings(model_name=MODEL_NAME, max_concurrent_requests=128, max_body_bytes=64 * 1024)


@pytest.fixture
async def fake_server(tmp_path, text_model, settings, engine_args, transport):
    """(base_url, app) of an HTTP app connected to a fake engine process; both stopped afterwards."""
    runtime_dir = tmp_path / "rt"
    proc = start_fake_engine(runtime_dir, text_model.vocab_size, *engine_args, transport=transport)
    app = make_app(settings, text_model, runtime_dir, open_fake_output)
    server = TestServer(app, handler_cancellation=True)
    await server.start_server()
    base_url = str(server.make_url("")).rstrip("/")
    try:
        await wait_healthy(base_url)
        yield base_url, app
    finally:
        await server.close()
        proc.stop()
