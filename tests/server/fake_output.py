"""Output transport of the fake engine: msgpack step frames on a Unix socket in the runtime dir.

NOTE: stands in for the output path of ipc/ (packed frames over message queues) until its reader is
committed; `FakeOutputSource` implements the server's OutputSource protocol exactly as that
reader's adapter does, so only this file changes when the fake engine switches transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from pathlib import Path

import msgspec

from mtpserve.server.outputs import OutputClosed, TokenDelta

SOCKET_NAME = "fake_output.sock"
_LEN = struct.Struct("<I")


class OutputRecord(msgspec.Struct, array_like=True):
    request_id: int
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    finish_reason: str | None


class FakeOutputSink:
    """Engine side: listens; every step's records go to the connected reader as one frame."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.descriptor = f"fake:{path}"
        self._writers: list[asyncio.StreamWriter] = []
        self._connected = asyncio.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._server: asyncio.AbstractServer | None = None

    @classmethod
    async def create(cls, runtime_dir: Path) -> FakeOutputSink:
        self = cls(Path(runtime_dir) / SOCKET_NAME)
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._accept, str(self.path))
        self.path.chmod(0o600)
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        self._connected.set()

    async def send(self, records: list[OutputRecord]) -> None:
        await self._connected.wait()
        payload = self._encoder.encode(records)
        for writer in self._writers:
            writer.write(_LEN.pack(len(payload)) + payload)
            await writer.drain()

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
        self.path.unlink(missing_ok=True)


class FakeOutputSource:
    """HTTP side: the server's OutputSource over the fake transport."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._decoder = msgspec.msgpack.Decoder(list[OutputRecord])

    @classmethod
    async def open(cls, descriptor: str) -> FakeOutputSource:
        path = descriptor.removeprefix("fake:")
        return cls(*await asyncio.open_unix_connection(path, limit=1 << 24))

    async def next_batch(self) -> list[TokenDelta]:
        try:
            (size,) = _LEN.unpack(await self._reader.readexactly(_LEN.size))
            records = self._decoder.decode(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise OutputClosed("fake output closed") from exc
        return [TokenDelta(*msgspec.structs.astuple(r)) for r in records]

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()
