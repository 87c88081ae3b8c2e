"""Another instance of the same role when the picked one cannot take the request.

Only failures that prove no engine started the request are retried: the connection was refused or
timed out (`unreachable`), or the instance answered 503 (`unavailable`: draining, not ready yet).
A 5xx, a reset after the request went out, or a timeout mid-answer is not: the instance may have
started it. Each instance is tried at most once per request, the next one picked by the usual policy.
A decode call is retried the same way: nothing of it has reached the client when its call fails.
A mixed instance's call is also retried when the connection was lost before its answer began
(`disconnected`: the instance died with the request): whatever it started died with it, and nothing
has reached the client, so another instance runs the request whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import aiohttp
import structlog

from mtpserve.router.backends import Backend, BackendPool, Reservation
from mtpserve.router.failures import BackendFailure

log = structlog.get_logger("mtpserve.router")
RETRYABLE = frozenset({"unreachable", "unavailable"})
RETRYABLE_MIXED = RETRYABLE | {"disconnected"}

Call = Callable[[Backend], AbstractAsyncContextManager[aiohttp.ClientResponse]]


@contextlib.asynccontextmanager
async def first_answer(pool: BackendPool, held: Reservation, call: Call, on_failover: Callable[[], None],
                       retryable: frozenset[str] = RETRYABLE) -> AsyncIterator[aiohttp.ClientResponse]:
    """`call(held.backend)`'s response, or the first answer of the other healthy backends in turn
    (`held` moves to each one tried). Failures raised after the response is handed out are the
    caller's: they are never retried."""
    tried: tuple[Backend, ...] = ()
    while True:
        calling = contextlib.AsyncExitStack()
        try:
            response = await calling.enter_async_context(call(held.backend))
        except BackendFailure as failure:
            await calling.aclose()
            tried += (held.backend,)
            following = pool.pick(exclude=tried) if failure.kind in retryable else None
            if following is None:
                raise
            log.warning("backend failover", role=pool.role, failed=held.backend.url, reason=failure.kind,
                        next=following.url)
            on_failover()
            held.move_to(following)
            continue
        async with calling:
            yield response
        return
