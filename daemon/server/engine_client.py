"""The HTTP process's handle on the engine: `open` a generation (engine_stream.py: submit with the
429 limit, updates, release), and the two loops that feed the tracker: control messages from the
request channel, deltas from the output path.

Request path: route -> `open` -> AddRequest per choice -> engine -> output path -> `_output_loop`
-> Tracker.dispatch -> RequestStream -> EngineStream (`next_updates`) -> `release` (AbortRequest if
needed).
PD (docs/pd.md): a prefill request's KVHeld comes through `_control_loop` into the same stream; the
KV of a prefill request whose kv_transfer_params were never answered is released with the stream.
Prefix caching (docs/prefix-caching.md): PrefixHits sets the choices' cached prompt tokens (usage);
`reset_prefix_cache` sends ResetPrefixCache and waits for the PrefixCacheReset with its token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from typing import NamedTuple

import msgspec
import structlog

from mtpserve.ipc.request_channel import (
    AbortRequest, AddRequest, ChannelClosed, EngineReady, EngineStats, KVHeld, PrefixCacheReset, PrefixHits,
    ReleaseKV, RemotePrefill, RequestChannelClient, RequestFailed, ResetPrefixCache, SamplingParams, ToHttp,
)
from mtpserve.ipc.frame_assembler import ReaderStats
from mtpserve.server.choice import ChoiceState, ChoiceUpdate
from mtpserve.server.detokenizer import Decoder, IncrementalDetokenizer
from mtpserve.server.engine_stream import EngineStream
from mtpserve.web.errors import ApiError
from mtpserve.server.health import EngineHealth, EngineState
from mtpserve.server.metrics import ServerMetrics
from mtpserve.server.outputs import OutputClosed, OutputSource
from mtpserve.server.stop_strings import StopStringMatcher
from mtpserve.server.tracker import RequestStream, Tracker

log = structlog.get_logger("mtpserve.server")


class GenerateRequest(NamedTuple):
    prompts: list[list[int]]  # one token list per prompt
    params: SamplingParams
    n: int
    stops: list[str]
    arrival: float  # time.monotonic() when the HTTP request arrived
    skip_special_tokens: bool = True
    include_stop_str: bool = False
    hold_kv: bool = False  # PD prefill: keep the KV after the first token (docs/pd.md)
    remote: RemotePrefill | None = None  # PD decode: the prompt was prefilled by another instance


class EngineClient:
    def __init__(self, channel: RequestChannelClient, output: OutputSource, ready: EngineReady,
                 decoder: Decoder, metrics: ServerMetrics, health: EngineHealth, max_active: int) -> None:
        self.ready = ready
        self._channel, self._output = channel, output
        self._decoder, self._metrics, self.health = decoder, metrics, health
        self._max_active = max_active
        self.tracker = Tracker()
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._resets: dict[int, asyncio.Future[int]] = {}  # ResetPrefixCache token -> blocks forgotten

    def start(self) -> None:
        self.health.ready()
        self._tasks = [asyncio.create_task(self._control_loop(), name="engine-control"),
                       asyncio.create_task(self._output_loop(), name="engine-output")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._output.close()
        await self._channel.close()

    def output_stats(self) -> ReaderStats:
        return self._output.stats()

    def open(self, req: GenerateRequest) -> EngineStream:
        """The generation as an async context manager and iterator (engine_stream.py)."""
        return EngineStream(self, req)

    def submit(self, req: GenerateRequest) -> RequestStream:
        """Register the choices and send them to the engine; 503 when not serving, 429 when full."""
        num_choices = len(req.prompts) * req.n
        self._check_admission(num_choices)
        stream = RequestStream(self._make_choices(req), req.prompts)
        if req.remote is not None:
            _prime(stream, req.remote.first_token_id)
        self.tracker.register(stream)
        try:
            for choice in stream.choices:
                if req.remote is not None:
                    self._output.expect_seq(choice.engine_id, 1)  # the first token was seq 0, on the prefill
                self._channel.send(_add_request(req, choice))
        except ChannelClosed:
            self.tracker.unregister(stream)
            raise ApiError(503, "The engine is not available.", code="engine_unavailable") from None
        self._metrics.prompt_tokens.inc(sum(map(len, req.prompts)) * req.n)
        self._metrics.http_active.set(self.tracker.num_active)
        return stream

    async def next_updates(self, stream: RequestStream) -> list[ChoiceUpdate]:
        updates = await stream.next_updates()
        stopped = [stream.choices[u.index].engine_id for u in updates
                   if u.finish_reason == "stop" and stream.choices[u.index].stopped_by_string]
        if stopped:
            self._send_abort(stopped)  # NOTE: a stop string ends the request in the engine too
        return updates

    def release(self, stream: RequestStream) -> None:
        """Forget the stream; abort what the engine may still be running (client gone, error, stop)
        and free the KV a prefill engine may hold for it when no decode instance was told about it."""
        to_abort = [c.engine_id for c in stream.choices if not c.finished]
        to_release = [c.engine_id for c in stream.choices if _may_hold_kv(c, stream)]
        for choice in stream.choices:
            choice.abort()
        self.tracker.unregister(stream)
        self._metrics.http_active.set(self.tracker.num_active)
        if to_abort:
            self._send_abort(to_abort)
        if to_release:
            self.release_kv(to_release)

    def release_kv(self, engine_ids: list[int]) -> None:
        """PD prefill: free held KV blocks (`POST /v1/pd/release`, or nobody will read them)."""
        with contextlib.suppress(ChannelClosed):
            self._channel.send(ReleaseKV(request_ids=engine_ids))

    async def reset_prefix_cache(self, timeout_s: float) -> int:
        """Have the engine forget every cached prefix; how many blocks it forgot. 503 when the engine
        is gone or does not answer in `timeout_s`."""
        if self.health.state is EngineState.DEAD:
            raise _unavailable(f"The engine is not available ({self.health.reason}).")
        # NOTE: the engine answers every connected HTTP process, so a token must not be another's.
        token = random.getrandbits(63)
        answer = self._resets[token] = asyncio.get_running_loop().create_future()
        try:
            self._channel.send(ResetPrefixCache(token))
            return await asyncio.wait_for(answer, timeout_s)
        except ChannelClosed:
            raise _unavailable("The engine is not available.") from None
        except TimeoutError:
            raise _unavailable(f"The engine did not reset the prefix cache within {timeout_s:g} s.") from None
        finally:
            del self._resets[token]

    def _send_abort(self, engine_ids: list[int]) -> None:
        with contextlib.suppress(ChannelClosed):
            self._channel.send(AbortRequest(request_ids=engine_ids))

    def _check_admission(self, num_choices: int) -> None:
        problem = None if self.health.accepting else self.health.reason
        if problem is not None:
            self._metrics.reject(503)
            raise ApiError(503, f"The server is not accepting requests ({problem}).", code="unavailable")
        if num_choices > self._max_active:  # NOTE: would never fit, so retrying (429) cannot help
            raise ApiError(400, f"The request asks for {num_choices} completions (prompts x n); the limit is "
                           f"{self._max_active}.", param="n", code="too_many_completions")
        if self.tracker.num_active + num_choices > self._max_active:
            self._metrics.reject(429)
            raise ApiError(429, f"Too many requests in flight (limit {self._max_active}); retry later.",
                           code="rate_limit_exceeded")

    def _make_choices(self, req: GenerateRequest) -> list[ChoiceState]:
        width = req.params.logprobs  # None: the request wants no logprobs
        return [ChoiceState(index, next(self._ids), IncrementalDetokenizer(self._decoder, req.skip_special_tokens),
                            StopStringMatcher(req.stops, req.include_stop_str), width, self._metrics, req.arrival,
                            req.hold_kv)
                for index in range(len(req.prompts) * req.n)]

    async def _control_loop(self) -> None:
        try:
            while True:
                self._on_control(await self._channel.recv())
        except (ChannelClosed, msgspec.DecodeError) as exc:
            self._engine_gone(f"request channel closed ({exc})")
        except Exception as exc:
            log.exception("control loop failed")
            self._engine_gone(f"control loop failed ({type(exc).__name__}: {exc})")

    def _on_control(self, msg: ToHttp) -> None:
        if isinstance(msg, PrefixHits):
            self.tracker.prefix_hits(msg)
        elif isinstance(msg, PrefixCacheReset):
            answer = self._resets.get(msg.token)
            if answer is not None and not answer.done():
                answer.set_result(msg.num_blocks)
        elif isinstance(msg, KVHeld):
            if not self.tracker.kv_held(msg):
                log.info("releasing KV held for a finished request", request_id=msg.request_id)
                self.release_kv([msg.request_id])
        elif isinstance(msg, EngineStats):
            self._metrics.observe_engine_stats(msg)
            self.health.heard(msg)
        elif isinstance(msg, RequestFailed):
            self._output.forget_seq(msg.request_id)
            self.tracker.fail(msg.request_id, ApiError(500, f"The engine failed the request: {msg.message}",
                                                       code="engine_error"))

    async def _output_loop(self) -> None:
        try:
            while True:
                self.tracker.dispatch(await self._output.next_batch())
        except OutputClosed as exc:
            self._engine_gone(f"output path closed ({exc})")
            self.health.unrecoverable.set()
        except Exception as exc:  # NOTE: fail visibly (503, /health) rather than leave streams hanging
            log.exception("output loop failed")
            self._engine_gone(f"output reader failed ({type(exc).__name__}: {exc})")

    def _engine_gone(self, reason: str) -> None:
        self.health.dead(reason)
        self.tracker.fail_all(ApiError(503, f"The engine stopped: {reason}", code="engine_dead"))
        for answer in self._resets.values():
            if not answer.done():
                answer.set_exception(ApiError(503, f"The engine stopped: {reason}", code="engine_dead"))


def _unavailable(message: str) -> ApiError:
    return ApiError(503, message, code="engine_unavailable")


def _add_request(req: GenerateRequest, choice: ChoiceState) -> AddRequest:
    return AddRequest(request_id=choice.engine_id, prompt_token_ids=req.prompts[choice.index // req.n],
                      sampling=_params_for(req.params, choice.index % req.n), arrival_time=time.time(),
                      hold_kv=req.hold_kv, remote_prefill=req.remote)


def _prime(stream: RequestStream, first_token_id: int) -> None:
    """PD decode: every choice starts after the prefill's first token (a 400 if that already stopped)."""
    for choice in stream.choices:
        choice.prime(first_token_id)
        if choice.stopped_by_string:
            raise ApiError(400, "The first token in `kv_transfer_params` already completes a stop string; "
                           "the prefill instance ends such requests itself.", param="kv_transfer_params",
                           code="invalid_value")


def _may_hold_kv(choice: ChoiceState, stream: RequestStream) -> bool:
    """A prefill engine keeps the KV unless the request stopped there (EOS or a stop token)."""
    engine_stopped = choice.finish_reason == "stop" and not choice.stopped_by_string
    return choice.hold_kv and choice.engine_id not in stream.handed_off and not engine_stopped


def _params_for(params: SamplingParams, sample_index: int) -> SamplingParams:
    """Choice i of n gets seed + i, so n seeded samples differ yet stay reproducible."""
    if params.seed is None or sample_index == 0:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + sample_index) % 2**64)
