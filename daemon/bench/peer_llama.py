"""llama.cpp for `mtpserve bench peer`: built once from the llama-cpp-python sdist into a cache directory,
then started as servers that `mtpserve bench serve`'s client drives like any OpenAI-compatible one.

The cache (default build/peer/) holds, each step skipped when its output exists:
  1. llama_cpp_python-<version>.tar.gz (`pip download --no-binary :all:`) and its unpacked tree, whose
     vendor/llama.cpp is the llama.cpp that version pins;
  2. venv/: llama-cpp-python[server] built from that sdist (one request at a time);
  3. llama-server/bin/llama-server: llama.cpp's own server (continuous batching), CPU only.
No step downloads anything but PyPI packages: the web UI's prebuilt assets, HTTPS and CURL are off.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from mtpserve.bench.serve_launch import Instance, _free_port

VERSION = "0.3.36"
# NOTE: every GPU backend is off by default in llama.cpp; these turn off what would reach the network
# (the UI download, HTTPS) or build more than the benchmark runs (llava/mtmd, tests, examples).
CMAKE_FLAGS = ("-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")


@dataclass(frozen=True)
class LlamaCache:
    root: Path

    @property
    def sdist(self) -> Path:
        return self.root / f"llama_cpp_python-{VERSION}.tar.gz"

    @property
    def source(self) -> Path:
        return self.root / f"llama_cpp_python-{VERSION}"

    @property
    def venv_python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def python_stamp(self) -> Path:
        return self.root / "venv" / f".llama-cpp-python-{VERSION}"

    @property
    def server_build(self) -> Path:
        return self.root / "llama-server"

    @property
    def server_binary(self) -> Path:
        return self.server_build / "bin" / "llama-server"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def build_seconds(self) -> Path:
        return self.root / "build-seconds.json"


def setup(cache: LlamaCache, python_server: bool, llama_server: bool, jobs: int) -> dict[str, float]:
    """Bring the cache up to what was asked; returns the seconds each step took when it ran (kept in the
    cache, so a later run that skips a step still reports it).

    1. download and unpack the sdist; 2. the llama-cpp-python venv; 3. the llama-server binary.
    """
    seconds: dict[str, float] = {}
    cache.root.mkdir(parents=True, exist_ok=True)
    _timed(seconds, "download", not cache.sdist.exists(), lambda: _download(cache))
    _timed(seconds, "unpack", not (cache.source / "vendor" / "llama.cpp").is_dir(), lambda: _unpack(cache))
    _timed(seconds, "llama-cpp-python", python_server and not cache.python_stamp.exists(),
           lambda: _install_python_server(cache, jobs))
    _timed(seconds, "llama-server", llama_server and not cache.server_binary.exists(),
           lambda: _build_llama_server(cache, jobs))
    known = json.loads(cache.build_seconds.read_text()) if cache.build_seconds.exists() else {}
    known |= {step: round(s, 1) for step, s in seconds.items()}
    cache.build_seconds.write_text(json.dumps(known, indent=2))
    return known


def _timed(seconds: dict[str, float], step: str, needed: bool, run: Callable[[], None]) -> None:
    if not needed:
        return
    print(f"peer setup: {step} ...", flush=True)
    start = time.monotonic()
    run()
    seconds[step] = time.monotonic() - start
    print(f"peer setup: {step} done in {seconds[step]:.0f} s", flush=True)


def _download(cache: LlamaCache) -> None:
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
          f"llama-cpp-python=={VERSION}", "-d", str(cache.root)], cache, "download")


def _unpack(cache: LlamaCache) -> None:
    with tarfile.open(cache.sdist) as archive:
        archive.extractall(cache.root, filter="data")


def _install_python_server(cache: LlamaCache, jobs: int) -> None:
    """A venv of its own; pip builds the local sdist (--find-links) with the same CMake flags."""
    _run([sys.executable, "-m", "venv", str(cache.venv_python.parents[1])], cache, "venv")
    env = {**os.environ, "CMAKE_ARGS": " ".join((*CMAKE_FLAGS, "-DLLAVA_BUILD=OFF")),
           "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    _run([str(cache.venv_python), "-m", "pip", "install", "--find-links", str(cache.root),
          "--no-binary", "llama-cpp-python", f"llama-cpp-python[server]=={VERSION}"], cache,
         "llama-cpp-python", env)
    cache.python_stamp.touch()


def _build_llama_server(cache: LlamaCache, jobs: int) -> None:
    source, build = cache.source / "vendor" / "llama.cpp", cache.server_build
    _run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *CMAKE_FLAGS],
         cache, "llama-server")
    _run(["cmake", "--build", str(build), "--config", "Release", "--target", "llama-server", "-j", str(jobs)],
         cache, "llama-server")


def _run(argv: list[str], cache: LlamaCache, step: str, env: dict[str, str] | None = None) -> None:
    """Run a setup command with its output in logs/<step>.log; on failure, the log's tail is the error."""
    cache.logs.mkdir(parents=True, exist_ok=True)
    log = cache.logs / f"{step}.log"
    with open(log, "a") as out:
        out.write(f"$ {shlex.join(argv)}\n")
        out.flush()
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"peer setup step {step} failed ({done.returncode}); log {log}:\n{tail}")


def start_llama_server(label: str, cache: LlamaCache, model: Path, threads: int, slots: int,
                       slot_context: int) -> Instance:
    """llama.cpp's server: `slots` sequences with continuous batching, each of `slot_context` tokens.

    NOTE: prompt caching is off (per request and the host-memory cache): mtpserve has no prefix cache,
    and the benchmark sends the warm-up prompts again.
    """
    port = _free_port()
    argv = [str(cache.server_binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots),
            "--ctx-size", str(slots * slot_context), "--cont-batching", "--no-cache-prompt",
            "--cache-ram", "0", "--no-webui"]
    return Instance(label, f"http://127.0.0.1:{port}", _popen(argv, cache, label), label)


class PythonServerInstance(Instance):
    """llama-cpp-python's server has no /health: it is ready once /v1/models answers."""

    health_path = "/v1/models"


def start_python_server(label: str, cache: LlamaCache, model: Path, threads: int,
                        context: int) -> PythonServerInstance:
    """llama-cpp-python's server. NOTE: a new request must queue, not interrupt the one streaming."""
    port = _free_port()
    argv = [str(cache.venv_python), "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", str(context), "--interrupt_requests", "false"]
    return PythonServerInstance(label, f"http://127.0.0.1:{port}", _popen(argv, cache, label), label)


def _popen(argv: list[str], cache: LlamaCache, label: str) -> subprocess.Popen:
    cache.logs.mkdir(parents=True, exist_ok=True)
    with open(cache.logs / f"{label}.log", "w") as out:
        out.write(f"$ {shlex.join(argv)}\n")
        out.flush()
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def llama_tokenize(session: aiohttp.ClientSession, url: str, text: str) -> list[int]:
    """llama-server's /tokenize, as mtpserve tokenizes: no BOS, special tokens in the text recognised."""
    async with session.post(f"{url}/tokenize", json={"content": text, "add_special": False}) as resp:
        resp.raise_for_status()
        return (await resp.json())["tokens"]


async def llama_greedy(session: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy ids from llama-server's own /completion: top-k 1 at temperature 0, no repeat penalty, no
    prompt cache; it stops at EOS."""
    body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0,
            "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True}
    async with session.post(f"{url}/completion", json=body) as resp:
        resp.raise_for_status()
        return (await resp.json())["tokens"]
