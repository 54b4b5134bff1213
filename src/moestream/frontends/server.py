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

import socket


def serve(app, host: str, port: int, *, log_level: str = "info", on_ready=None) -> None:
    """Run `app` with uvicorn on host:port (port 0: any free port). The socket is bound and listening
    before `on_ready(actual_port)` is called, so a client may connect as soon as it hears of the port."""
    import uvicorn

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
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
