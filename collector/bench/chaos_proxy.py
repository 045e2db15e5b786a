"""A loopback TCP proxy that can break the network between two tracetop parts, for chaos runs.

    proxy = ChaosProxy(upstream=("127.0.0.1", 7000))   # listens on 127.0.0.1, a free port
    proxy.start(); proxy.address                      # "127.0.0.1:PORT": give this to the shippers
    proxy.stall()    # keep connections open but forward nothing (a partition TCP does not notice)
    proxy.drop()     # reset every connection and refuse new ones (a partition TCP does notice)
    proxy.heal()     # forward again
    proxy.stop()

Only loopback addresses, both sides (it is a test and benchmark aid). One asyncio loop in its own
thread; a stalled direction simply stops reading, so TCP flow control pushes back on the sender.
"""

from __future__ import annotations

import asyncio
import threading

PASS, STALL, DROP = "pass", "stall", "drop"


class ChaosProxy:
    def __init__(self, upstream: tuple[str, int], listen_host: str = "127.0.0.1") -> None:
        if not (upstream[0].startswith("127.") or upstream[0] == "localhost") or not listen_host.startswith("127."):
            raise ValueError("ChaosProxy forwards between loopback addresses only")
        self.upstream = upstream
        self.listen_host = listen_host
        self.mode = PASS
        self.connections = 0
        self.bytes_forwarded = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    def start(self) -> ChaosProxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(10)
        return self

    async def _start(self) -> None:
        self._flowing.set()
        self._server = await asyncio.start_server(self._client, self.listen_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def _set(self, mode: str) -> None:
        async def change() -> None:
            self.mode = mode
            if mode == PASS:
                self._flowing.set()
            else:
                self._flowing.clear()
            if mode == DROP:
                for w in list(self._writers):
                    w.transport.abort()  # RST: both ends see the connection die
                self._writers.clear()

        asyncio.run_coroutine_threadsafe(change(), self._loop).result(10)

    def stall(self) -> None:
        self._set(STALL)

    def drop(self) -> None:
        self._set(DROP)

    def heal(self) -> None:
        self._set(PASS)

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.transport.abort()

        try:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == DROP:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await self._flowing.wait()
            data = await reader.read(65536)
            if not data:
                return
            await self._flowing.wait()  # a stall that began mid-read holds this chunk too
            if self.mode == DROP or writer.is_closing():
                return
            writer.write(data)
            self.bytes_forwarded += len(data)
            await writer.drain()
