"""The request channel: HTTP process <-> rank 0, over a Unix domain stream socket.

HTTP -> engine: `AddRequest`, `AbortRequest`, `ReleaseKV`, `ResetPrefixCache`.  Engine -> HTTP:
`EngineReady`, `EngineStats`, `RequestFailed`, `KVHeld`, `PrefixHits`, `PrefixCacheReset` (ReleaseKV and
KVHeld only under PD: docs/pd.md).
Generated tokens do NOT travel here: they use the output path (ipc/ frames over message queues).
This channel carries the low-rate control traffic only.

Wire: every frame is a 4-byte little-endian payload length followed by a msgspec MessagePack payload
of a tagged Struct (no pickle).  The engine listens (`RequestChannelServer`), the HTTP process
connects (`RequestChannelClient`); the socket file is 0600 inside a 0700 runtime directory.

Lifecycle (engine side):
  1. `server = await RequestChannelServer.start(runtime_dir)` — binds `<runtime_dir>/request.sock`,
     removing a stale socket left by a dead instance, refusing to start when a live one answers.
  2. the rank loop drains `server.poll()` (never blocks) or awaits `server.recv()`.
  3. `server.set_ready(EngineReady(...))` once the model is loaded; late clients get it on connect.
  4. `server.send(EngineStats(...))` every ~0.25-0.5 s, idle or not: it is the heartbeat `/health`
     watches (no stats, or a frozen step_id while requests run, for 10 s = unhealthy).
  5. AbortRequest: free the ids it knows, ignore the others (a finished request may be aborted
     late); a final ABORT frame for them is optional (the HTTP side has already let them go).
  6. RequestFailed when a request cannot be served (it ends that request with an error).
Lifecycle (HTTP side):
  1. `client = await RequestChannelClient.connect(runtime_dir, timeout_s)` (retries until the socket
     exists), 2. `ready = await client.wait_ready(timeout_s)`, 3. `client.send(AddRequest(...))`,
  4. `await client.recv()` for stats/failures; raises `ChannelClosed` when the engine dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any, Union

import msgspec

from mtpserve.ipc.sampling_params import SamplingParams

SOCKET_NAME = "request.sock"
MAX_FRAME_BYTES = 64 << 20  # a 1M-token prompt packs to ~5 MB; anything larger is corruption
_LEN = struct.Struct("<I")


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where a rank's paged KV lives, for one-sided reads by another instance (docs/pd.md).

    Buffers in a fixed order: layer 0 K, layer 0 V, layer 1 K, ..., then MTP depth 0 K, V, ...
    Block b of buffer i starts at `buffer_addrs[i] + b * block_bytes[i]`.
    """

    block_size: int  # tokens per block
    buffer_addrs: list[int]
    block_bytes: list[int]


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt another instance prefilled (decode role): where its KV is and what it sampled."""

    kv_session: str  # the prefill rank's Mooncake session, "host:rpc_port"
    kv_layout: KVLayout  # the prefill rank's layout
    block_ids: list[int]  # prefill blocks holding positions 0 .. len(prompt)-1, in order
    first_token_id: int
    draft_token_ids: list[int]  # the k MTP drafts after the first token
    lease_deadline: float  # time.time() after which the prefill may have freed the blocks
    # NOTE: the first position whose MTP KV the prefill wrote (a block start; None: an older prefill that did
    # not say, derived here from this instance's window). The drafts attend from it (engine/mtp_window.py).
    mtp_key_start: int | None = None


class AddRequest(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    request_id: int  # unique per instance; the output frames carry the same id
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0  # time.time() at HTTP arrival, for queue-time metrics
    # NOTE: prefill role: keep the KV after the first token (unless it stopped) and report KVHeld.
    hold_kv: bool = False
    remote_prefill: RemotePrefill | None = None  # decode role: start from another instance's prefill


class ReleaseKV(msgspec.Struct, frozen=True, tag=True):
    """Prefill role: the decode instance has the KV (or never will); free these held blocks."""

    request_ids: list[int]


class ResetPrefixCache(msgspec.Struct, frozen=True, tag=True):
    """Forget every cached prefix (admin endpoint): blocks no request uses are freed, blocks in use are
    no longer matched. The engine answers with PrefixCacheReset carrying the same `token`."""

    token: int


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    """Free these requests (client gone, stop string hit). Unknown ids are ignored."""

    request_ids: list[int]


class EngineReady(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_speculative_tokens: int = 0  # k drafts per step (0 = MTP off)
    num_kv_blocks: int = 0
    kv_block_size: int = 0
    output_channel: str = ""  # opaque descriptor the output reader opens (ipc/ decides)
    role: str = "mixed"  # pd.role
    kv_session: str = ""  # prefill/decode roles: this rank's Mooncake session, "host:rpc_port"
    kv_layout: KVLayout | None = None  # prefill/decode roles


class EngineStats(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Gauges now plus counters since engine start (cumulative, so a lost frame loses nothing)."""

    step_id: int
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_pos: list[int] = []  # [k]: accepted drafts at each draft position
    num_drafted_per_pos: list[int] = []  # [k]: windows that drafted at each position
    num_rows_by_drafts: list[int] = []  # [k+1]: rows whose next window the policy gave 0..k drafts
    spec_predicted_seconds: float = 0.0  # the policy's cost model, summed over steps
    spec_measured_seconds: float = 0.0  # the same steps' device time
    timestamp: float = 0.0
    # NOTE: PD (docs/pd.md). Prefill role: held KV and expired leases; decode role: KV reads.
    num_kv_held: int = 0
    num_kv_leases_expired: int = 0
    num_kv_fetches: int = 0
    kv_fetch_bytes: int = 0
    kv_fetch_seconds: float = 0.0
    num_kv_fallbacks: int = 0  # prefilled prompts recomputed here (read failed or lease too short)
    num_preemptions: int = 0  # running requests sent back to waiting to free KV blocks
    num_discarded_rows: int = 0  # computed rows whose request finished, aborted or was preempted after launch
    # NOTE: prefix caching (docs/prefix-caching.md), counted in tokens as vLLM counts them: a query is
    # a prompt looked up at admission, a hit a prompt token whose KV came from the cache.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_kv_blocks_cached: int = 0  # blocks whose content can be matched (in use or evictable)
    num_kv_blocks_evictable: int = 0  # cached blocks no request uses: free, kept until evicted (LRU)


class RequestFailed(msgspec.Struct, frozen=True, tag=True):
    """The engine refused or lost a request; no further output frames will come for it."""

    request_id: int
    message: str


class PrefixHits(msgspec.Struct, frozen=True, tag=True):
    """Prompt tokens whose KV came from the prefix cache, per request (usage's cached_tokens).

    Sent when the step that admits the requests launches, so before any of their output frames
    exists; only for requests with a hit (no entry means 0). A preempted request that is admitted
    again is not reported twice: its first admission counts."""

    request_ids: list[int]
    cached_tokens: list[int]


class PrefixCacheReset(msgspec.Struct, frozen=True, tag=True):
    """The answer to ResetPrefixCache: how many cached blocks were forgotten."""

    token: int
    num_blocks: int


class KVHeld(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Prefill role: the request's KV stays in these blocks until ReleaseKV or the lease ends.

    Sent before the request's FIRST_TOKEN frame is sent."""

    request_id: int
    block_ids: list[int]
    num_tokens: int  # positions with KV (the prompt length)
    lease_expires_in: float  # seconds
    mtp_key_start: int = 0  # the first position whose MTP KV the prefill wrote (its drafts' key start)


ToEngine = Union[AddRequest, AbortRequest, ReleaseKV, ResetPrefixCache]
ToHttp = Union[EngineReady, EngineStats, RequestFailed, KVHeld, PrefixHits, PrefixCacheReset]


class ChannelClosed(ConnectionError):
    """The peer closed the socket (engine died or HTTP process left)."""


def socket_path(runtime_dir: str | os.PathLike) -> Path:
    return Path(runtime_dir) / SOCKET_NAME


class FrameCodec:
    """Length-prefixed msgpack frames for one direction's message union."""

    def __init__(self, decode_type: Any) -> None:
        """`decode_type`: the Union of one direction's message Structs (ToEngine or ToHttp)."""
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)

    def encode(self, msg: msgspec.Struct) -> bytes:
        payload = self._encoder.encode(msg)
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
        return _LEN.pack(len(payload)) + payload

    async def read(self, reader: asyncio.StreamReader):
        """Next message; `ChannelClosed` at a clean EOF or a truncated frame."""
        try:
            (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if size > MAX_FRAME_BYTES:
                raise msgspec.DecodeError(f"frame length {size} exceeds {MAX_FRAME_BYTES}")
            return self._decoder.decode(await reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
            raise ChannelClosed("request channel closed") from exc


class RequestChannelClient:
    """HTTP side: sends ToEngine, receives ToHttp."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._codec_out = FrameCodec(ToEngine)
        self._codec_in = FrameCodec(ToHttp)

    @classmethod
    async def connect(cls, runtime_dir: str | os.PathLike, timeout_s: float = 60.0) -> RequestChannelClient:
        """Connect, retrying while the engine has not bound its socket yet."""
        path, deadline = socket_path(runtime_dir), time.monotonic() + timeout_s
        while True:
            try:
                return cls(*await asyncio.open_unix_connection(str(path), limit=MAX_FRAME_BYTES))
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no engine listening on {path} after {timeout_s}s") from None
                await asyncio.sleep(0.05)

    def send(self, msg: ToEngine) -> None:
        """Queue a frame on the transport (never blocks; the kernel buffer drains it)."""
        if self._writer.is_closing():
            raise ChannelClosed("request channel closed")
        self._writer.write(self._codec_out.encode(msg))

    async def drain(self) -> None:
        await self._writer.drain()

    async def recv(self) -> ToHttp:
        return await self._codec_in.read(self._reader)

    async def wait_ready(self, timeout_s: float = 600.0) -> EngineReady:
        """Skip anything before the engine's EngineReady (nothing else is sent before it)."""
        async with asyncio.timeout(timeout_s):
            while not isinstance(msg := await self.recv(), EngineReady):
                pass
            return msg

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()


class RequestChannelServer:
    """Engine side: accepts HTTP processes, merges their ToEngine messages into one inbox."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._inbox: asyncio.Queue[ToEngine] = asyncio.Queue()
        self._writers: set[asyncio.StreamWriter] = set()
        self._codec_in = FrameCodec(ToEngine)
        self._codec_out = FrameCodec(ToHttp)
        self._ready: EngineReady | None = None
        self._server: asyncio.AbstractServer | None = None

    @classmethod
    async def start(cls, runtime_dir: str | os.PathLike) -> RequestChannelServer:
        path = socket_path(runtime_dir)
        _prepare_runtime_dir(path.parent)
        _remove_stale_socket(path)
        self = cls(path)
        self._server = await asyncio.start_unix_server(self._serve_client, str(path), limit=MAX_FRAME_BYTES)
        os.chmod(path, 0o600)  # NOTE: the 0700 directory already closes the bind->chmod window
        return self

    def poll(self) -> list[ToEngine]:
        """Every message received so far, without waiting (the rank loop's intake)."""
        msgs = []
        while not self._inbox.empty():
            msgs.append(self._inbox.get_nowait())
        return msgs

    async def recv(self) -> ToEngine:
        return await self._inbox.get()

    def set_ready(self, ready: EngineReady) -> None:
        self._ready = ready
        self.send(ready)

    def send(self, msg: ToHttp) -> None:
        """Broadcast to every connected HTTP process (there is normally one)."""
        frame = self._codec_out.encode(msg)
        for writer in list(self._writers):
            if not writer.is_closing():
                writer.write(frame)

    @property
    def num_clients(self) -> int:
        return len(self._writers)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self._ready is not None:
            writer.write(self._codec_out.encode(self._ready))
        try:
            while True:
                self._inbox.put_nowait(await self._codec_in.read(reader))
        except (ChannelClosed, msgspec.DecodeError):
            pass  # NOTE: a client sending garbage is dropped, the engine keeps serving the others
        finally:
            self._writers.discard(writer)
            writer.close()


def _prepare_runtime_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        raise PermissionError(f"runtime directory {path} must not be accessible to group/others (chmod 700)")


def _remove_stale_socket(path: Path) -> None:
    """Unlink a socket nobody answers on; refuse when a live instance owns it."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise FileExistsError(f"another engine is listening on {path}")
