"""uvicorn, hardened: a deadline on reading each request, and a shutdown that drains.

- `GuardedH11Protocol` closes a connection whose client has not sent a whole request (headers
  and body) within `request_read_timeout` seconds of starting it, or of connecting. uvicorn
  has no such timer, so a client trickling bytes (slowloris) would hold a connection forever.
  It also closes a refused request's connection gently (a lingering close): uvicorn answers
  a malformed or oversized request with 400 and closes at once, and if the client is still
  sending (a 64 KiB header), the unread bytes make the kernel reset the connection, which can
  destroy the 400 before the client reads it.
- `Server` turns SIGTERM/SIGINT into a drain: stop accepting, answer new requests on open
  connections with 503, let running requests finish for `shutdown_timeout` seconds, then end
  every open stream with an error event and `[DONE]` (`Shutdown.stop_streams`), and exit 0 (uvicorn
  would re-raise the signal and die by it). `Server.fail(code)` ends the server with that exit
  code (the engine died: a supervisor should restart the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import weakref

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

logger = logging.getLogger("jaxllm.server")


LINGER_S = 2.0  # how long a refused client's remaining bytes are read and dropped


def guarded_protocol(read_timeout: float) -> type[H11Protocol]:
    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _lingering = False

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # what a refused client still sends: dropped
            if self._timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first bytes of a request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()  # the whole request is in

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(read_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def send_400_response(self, msg: str) -> None:
            """uvicorn's 400 for a request h11 refuses, then a half-close instead of a close."""
            headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
            for event in (
                h11.Response(status_code=400, headers=headers, reason=STATUS_PHRASES[400]),
                h11.Data(data=msg.encode("ascii")),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
            self._disarm()
            self._lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()  # the response goes out, then our FIN
            self.loop.call_later(LINGER_S, self.transport.close)  # at the latest; the client's EOF closes it sooner

        def _too_slow(self) -> None:
            self._timer = None
            logger.warning("closing a connection from %s: no whole request within %.0f s", self.client, read_timeout)
            self.transport.close()

    return GuardedH11Protocol


class Shutdown:
    """What handlers need to know about a shutdown: `draining` (no new work) and, once the grace
    period is over, every registered stream is told to stop."""

    def __init__(self):
        self.draining = False
        self._streams: weakref.WeakSet = weakref.WeakSet()

    def register(self, stream) -> None:
        """`stream.stop()` is called when the grace period ends."""
        self._streams.add(stream)

    def stop_streams(self) -> int:
        streams = list(self._streams)
        for stream in streams:
            stream.stop()
        return len(streams)


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, shutdown: Shutdown, shutdown_timeout: float, on_ready=None):
        super().__init__(config)
        self.shutdown_state, self.shutdown_timeout, self.on_ready = shutdown, shutdown_timeout, on_ready
        self.exit_code = 0

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if not self.should_exit and self.on_ready is not None:
            self.on_ready()

    def fail(self, code: int) -> None:
        """End the server with exit status `code` (safe from any thread)."""
        self.exit_code = code
        self.should_exit = True

    async def shutdown(self, sockets=None):
        self.shutdown_state.draining = True
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._end_streams)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_streams(self) -> None:
        count = self.shutdown_state.stop_streams()
        if count:
            logger.warning("shutdown timeout (%.0f s) reached: ending %d open request(s)", self.shutdown_timeout, count)

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT/SIGTERM start the drain; unlike uvicorn's, the signal is not re-raised afterwards,
        so a drained server exits with status 0."""
        handled = (signal.SIGINT, signal.SIGTERM)
        try:
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        except ValueError:  # not the main thread: no signals to take
            yield
            return
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
