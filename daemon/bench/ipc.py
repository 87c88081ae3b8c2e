"""`mtpserve bench ipc`: cost of the output path per step, for a grid of (batch, tokens per request,
top-k) and each transport (POSIX / SysV queue, payload through the shared-memory ring or chunked).

Two measurements:
  serial     one process runs pack+send (the C++ op) and receive+decode (PollingReader) back to back:
             the CPU cost of one step's outputs, no scheduler noise.
  pipelined  the op runs in this process, an asyncio OutputReader in a child process, as in the
             daemon; µs per step = wall time / steps with the sender flushing under back-pressure.
Bytes per step are what crosses the queue and the ring (headers included), next to FastDeploy's fixed
530,448-byte speculative logprob message. Writes JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FASTDEPLOY_SPEC_LOGPROB_BYTES = 530_448
GOAL_US = 200.0  # at batch 128, 4 tokens, top-5
VOCAB = 151_936
BACKOFF_S = 50e-6  # pipelined sender's pause while frames are pending


@dataclass(frozen=True)
class Cell:
    transport: str
    chunked: bool
    batch: int
    tokens: int
    topk: int

    @property
    def mode(self) -> str:
        return f"{self.transport}-{'chunked' if self.chunked else 'ring'}"


@dataclass(frozen=True)
class Result:
    mode: str
    batch: int
    tokens: int
    topk: int
    us_per_step: float  # mean (serial) or wall time / steps (pipelined)
    us_median: float  # median of per-step times (serial; robust to a loaded host); pipelined: = mean
    cpu_us: float  # CPU time per step, all processes and threads (does not count waiting for a CPU)
    frames_per_s: float
    bytes_per_step: int
    messages_per_step: float
    vs_fastdeploy: float  # bytes_per_step / 530,448


def _step_tensors(batch: int, tokens: int, topk: int, seed: int = 0) -> dict:
    import paddle

    from mtpserve import ops

    rng = np.random.default_rng(seed)
    n = batch * tokens
    t = paddle.to_tensor
    lp = None if topk == 0 else ops.StepLogprobs(
        t(rng.standard_normal(n).astype(np.float32)), t(rng.integers(1, 100, n)),
        t(rng.integers(0, VOCAB, (n, topk))), t(rng.standard_normal((n, topk)).astype(np.float32)))
    return dict(req_ids=t(np.arange(batch, dtype=np.int64)), num_tokens=t(np.full(batch, tokens, np.int32)),
                finish=t(np.zeros(batch, np.int32)), token_ids=t(rng.integers(0, VOCAB, n)),
                logprobs=lp, num_topk=topk)


def _seq_tensors(batch: int, tokens: int, steps: int) -> list:
    import paddle

    # NOTE: built before timing: the engine keeps seq on the host already.
    return [paddle.to_tensor(np.full(batch, i * tokens, np.int64)) for i in range(steps)]


def _send(sender, tensors: dict, seq, step_id: int):
    return sender.send_step(step_id=step_id, seq=seq, **tensors)


def _open(cell: Cell, ring_bytes: int):
    from mtpserve import ops
    from mtpserve.ipc.output_channel import OutputChannel

    ch = OutputChannel.create(f"bench{os.getpid()}-{uuid.uuid4().hex[:6]}", cell.transport,
                              chunked=cell.chunked, ring_bytes=ring_bytes)
    return ch, ops.OutputSender(ch.address, rank=0, vocab_size=VOCAB)


def run_serial(cell: Cell, steps: int, warmup: int, ring_bytes: int) -> Result:
    from mtpserve.ops import SendStatus
    from mtpserve.ipc.polling_reader import PollingReader

    ch, sender = _open(cell, ring_bytes)
    reader = PollingReader(ch, vocab_size=VOCAB)
    tensors = _step_tensors(cell.batch, cell.tokens, cell.topk)
    seqs = _seq_tensors(cell.batch, cell.tokens, warmup + steps)
    try:
        for i in range(warmup):
            _serial_step(sender, reader, tensors, seqs[i], i, SendStatus)
        before = (reader.stats.messages, reader.stats.payload_bytes, reader.stats.frames)
        times = np.empty(steps)
        cpu_start = time.process_time()
        for i in range(warmup, warmup + steps):
            start = time.perf_counter()
            _serial_step(sender, reader, tensors, seqs[i], i, SendStatus)
            times[i - warmup] = time.perf_counter() - start
        cpu_us = (time.process_time() - cpu_start) / steps * 1e6
        _check_clean(reader.stats, warmup + steps)
        return _result(cell, times, cpu_us, reader.stats, before)
    finally:
        reader.close()
        sender.close()
        ch.remove()


def _serial_step(sender, reader, tensors, seq, step_id, status_of) -> None:
    status = status_of.of(_send(sender, tensors, seq, step_id))
    got = len(reader.poll())
    while status.frames_pending:  # chunked frames larger than the queue: read, then flush
        status = status_of.of(sender.flush())
        got += len(reader.poll())
    got += len(reader.poll())
    assert got == 1, f"step {step_id}: {got} frames"


def _check_clean(stats, frames: int) -> None:
    assert stats.frames == frames and not stats.rejected and stats.seq_errors == 0, stats


def _per_frame(stats, before: tuple) -> tuple[float, float]:
    """(bytes per frame on the wire, queue messages per frame) since the `before` snapshot."""
    frames = stats.frames - before[2]
    messages = (stats.messages - before[0]) / frames
    return (stats.payload_bytes - before[1]) / frames + 64 * messages, messages


def _result(cell: Cell, times: np.ndarray, cpu_us: float, stats, before: tuple) -> Result:
    wire_bytes, messages = _per_frame(stats, before)
    us = float(times.mean()) * 1e6
    return Result(cell.mode, cell.batch, cell.tokens, cell.topk, round(us, 1),
                  round(float(np.median(times)) * 1e6, 1), round(cpu_us, 1), round(1e6 / us),
                  int(wire_bytes),
                  round(messages, 2), round(wire_bytes / FASTDEPLOY_SPEC_LOGPROB_BYTES, 4))


def run_pipelined(cell: Cell, steps: int, warmup: int, ring_bytes: int) -> Result:
    """Sender here, asyncio reader in a child process; timed from the first send to the last frame."""
    from mtpserve.ops import SendStatus

    ch, sender = _open(cell, ring_bytes)
    child = subprocess.Popen([sys.executable, "-m", "mtpserve.bench.ipc", "--reader-child",
                              ch.address.instance, str(warmup + steps), str(warmup)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        tensors = _step_tensors(cell.batch, cell.tokens, cell.topk)
        seqs = _seq_tensors(cell.batch, cell.tokens, warmup + steps)
        cpu_start = time.process_time()
        for i in range(warmup + steps):
            if i == warmup:
                cpu_start = time.process_time()
            status = SendStatus.of(_send(sender, tensors, seqs[i], i))
            while status.frames_pending:  # back-pressure: the engine pauses scheduling here
                time.sleep(BACKOFF_S)  # NOTE: a real sleep: spinning would starve the reader's CPU
                status = SendStatus.of(sender.flush())
        sender_cpu = time.process_time() - cpu_start
        report = json.loads(child.stdout.readline())
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
        sender.close()
        ch.remove()
    us = report["elapsed"] / steps * 1e6
    cpu_us = (sender_cpu + report["cpu"]) / steps * 1e6
    return Result(cell.mode, cell.batch, cell.tokens, cell.topk, round(us, 1), round(us, 1),
                  round(cpu_us, 1), round(1e6 / us),
                  int(report["bytes_per_frame"]), report["messages_per_frame"],
                  round(report["bytes_per_frame"] / FASTDEPLOY_SPEC_LOGPROB_BYTES, 4))


def _cells(args: argparse.Namespace) -> list[Cell]:
    modes = [(t, m == "chunked") for t in args.transports for m in args.payload]
    return [Cell(t, c, b, n, k) for t, c in modes for b in args.batches for n in args.tokens for k in args.topk]


def _print(results: list[Result], title: str) -> None:
    print(f"\n{title}  (FastDeploy fixed message: {FASTDEPLOY_SPEC_LOGPROB_BYTES:,} B)")
    print(f"{'mode':<14}{'batch':>6}{'tok':>4}{'topk':>5}{'us/step':>10}{'median':>9}{'cpu us':>8}"
          f"{'frames/s':>10}{'bytes/step':>12}{'msgs':>6}{'vs FD':>8}")
    for r in results:
        print(f"{r.mode:<14}{r.batch:>6}{r.tokens:>4}{r.topk:>5}{r.us_per_step:>10.1f}"
              f"{r.us_median:>9.1f}{r.cpu_us:>8.1f}{r.frames_per_s:>10,}{r.bytes_per_step:>12,}"
              f"{r.messages_per_step:>6}{r.vs_fastdeploy:>8.3f}", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _words(text: str) -> list[str]:
    return text.split(",")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ipc", help="output path cost per step (pack+send+receive+decode)")
    p.add_argument("--batches", type=_ints, default=[1, 32, 128, 256])
    p.add_argument("--tokens", type=_ints, default=[1, 4])
    p.add_argument("--topk", type=_ints, default=[0, 5, 20])
    p.add_argument("--transports", type=_words, default=["posix", "sysv"])
    p.add_argument("--payload", type=_words, default=["ring", "chunked"],
                   help="ring: payload in shared memory; chunked: payload split into queue messages")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ring-bytes", type=int, default=4 << 20)
    p.add_argument("--pipelined", action="store_true", help="also run the two-process measurement")
    p.add_argument("--json", type=Path, default=Path("runs/bench_ipc.json"))
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} on {os.cpu_count()} CPUs (a busy host inflates the means)")
    cells = _cells(args)
    serial = [run_serial(c, args.steps, args.warmup, args.ring_bytes) for c in cells]
    _print(serial, "serial: pack+send+receive+decode in one process")
    out = {"serial": [asdict(r) for r in serial], "goal_us": GOAL_US,
           "fastdeploy_bytes": FASTDEPLOY_SPEC_LOGPROB_BYTES, "loadavg_at_start": load,
           "cpus": os.cpu_count()}
    if args.pipelined:
        piped = [run_pipelined(c, args.steps, args.warmup, args.ring_bytes) for c in cells]
        _print(piped, "pipelined: op in this process, asyncio reader in another")
        out["pipelined"] = [asdict(r) for r in piped]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json}")
    return 0


async def _reader_child(instance: str, total: int, warmup: int) -> dict:
    """The HTTP side of the pipelined run: an asyncio OutputReader draining `total` frames."""
    from mtpserve.ipc.output_channel import OutputChannel
    from mtpserve.ipc.output_reader import OutputReader

    channel = OutputChannel.attach(instance)
    reader = OutputReader(channel, vocab_size=VOCAB)
    await reader.start()
    print("ready", flush=True)
    for _ in range(warmup):
        await reader.get()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(total - warmup):
        await reader.get()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stats = reader.stats
    # NOTE: over the whole run: the SysV thread decodes ahead of get(), so a mid-run snapshot lies.
    wire_bytes, messages = _per_frame(stats, (0, 0, 0))
    await reader.close()
    channel.close()
    _check_clean(stats, total)
    return {"elapsed": elapsed, "cpu": cpu, "messages_per_frame": round(messages, 2),
            "bytes_per_frame": wire_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtpserve bench")
    add_parser(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reader-child"]:
        import uvloop

        report = uvloop.run(_reader_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        print(json.dumps(report), flush=True)
        raise SystemExit(0)
    raise SystemExit(main(["ipc", *sys.argv[1:]]))
