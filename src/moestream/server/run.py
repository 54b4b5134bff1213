"""Running the HTTP app with uvicorn, for `moestream serve` (commands/serve.py builds the app and calls `serve`).

The server is three pieces, one module each:
- openai_api.py: OpenAI's request models, their translation into a generation (prompt ids, sampling
  parameters, stop sequences, max tokens), and of results into OpenAI response and chunk objects;
- worker.py: the one thread that runs the model (it is not thread-safe): requests from a first-in
  first-out queue join a batch decoded together (batching.py), with cancellation and deadlines;
- http_app.py: the FastAPI app: routes, error handlers, server-sent events, metrics.

This module imports uvicorn only inside `serve`, and commands/serve.py imports FastAPI only when it runs
(the server is an optional extra): `moestream serve --help` works without them, and a missing extra is
named when the verb runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time

log = logging.getLogger("moestream.serve")

CLOSE_RESERVE_SECONDS = 5.0  # of the shutdown timeout, kept for ending the running requests and exiting
MIN_GRACEFUL_SECONDS = 1.0  # uvicorn's wait for the last bytes of each connection, however late the close came


def serve(app, host: str, port: int, *, log_level: str = "info", on_ready=None, shutdown_timeout: float = 30.0) -> None:
    """Run `app` with uvicorn on host:port (port 0: any free port). The socket is bound and listening
    before `on_ready(actual_port)` is called, so a client may connect as soon as it hears of the port.

    A clean stop: the first SIGTERM (or Ctrl-C) stops admitting (new generation requests get 503 with
    Retry-After, /health 503), lets the running requests finish for up to `shutdown_timeout` seconds, ends the
    rest with an error event in each stream, and returns (the command exits 0); a second signal exits at once."""
    import uvicorn

    # The process must be gone by `shutdown_timeout`: the requests still running are ended a little before
    # it, which leaves time for the step to end (at its next layer) and for their streams' last events.
    close_at = shutdown_timeout - min(CLOSE_RESERVE_SECONDS, shutdown_timeout / 4)

    class DrainingServer(uvicorn.Server):
        draining_since: float | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.draining_since is None:  # the first signal: drain (on_tick decides when to stop)
                self.draining_since = time.monotonic()
                app.state.service.draining = True
                log.warning("stopping: no new requests; running ones get up to %g s (signal again to exit now)", shutdown_timeout)
            else:
                self.should_exit = self.force_exit = True

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises a captured signal after its shutdown, so that the process dies of it; a clean
            # stop here is an exit code 0, so the signals are only handled.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def on_tick(self, counter: int) -> bool:
            if self.draining_since is not None and not self.should_exit:
                worker = app.state.service.worker
                idle = worker.running() == 0 and worker.queued() == 0
                if idle or time.monotonic() - self.draining_since >= close_at:
                    if not idle:  # the rest end now, each stream with an error event (worker.ShuttingDown)
                        await asyncio.to_thread(worker.close)
                    # uvicorn then waits for the connections to send their last bytes: only for what is left
                    left = shutdown_timeout - (time.monotonic() - self.draining_since)
                    self.config.timeout_graceful_shutdown = max(MIN_GRACEFUL_SECONDS, left)
                    self.should_exit = True
            return await super().on_tick(counter)

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    if on_ready is not None:
        on_ready(sock.getsockname()[1])
    server = DrainingServer(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
