"""A raw ASGI conversation whose client goes away: the first ``receive()`` gives the request
body, the next one waits for ``gone`` and then says ``http.disconnect`` (what uvicorn's
receive() answers when the peer closed). Tests of job cancellation on disconnect use it."""
from __future__ import annotations

import asyncio
from typing import Callable


class GoneClient:
    """One POST of ``body`` to ``path`` through ``app(scope, receive, send)``.

    ``sent``: every ASGI message the app sent; ``gone``: set it (or let ``on_send`` return
    True for a message) and the client disconnects at the app's next ``receive()``."""

    def __init__(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]] = (),
                 on_send: Callable[[dict], bool] | None = None):
        self.path, self.body = path, body
        self.headers = [(b"content-type", b"application/json"), *headers,
                        (b"content-length", str(len(body)).encode())]
        self.on_send = on_send
        self.gone = asyncio.Event()
        self.sent: list[dict] = []
        self._first = True

    async def receive(self) -> dict:
        if self._first:
            self._first = False
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, msg: dict) -> None:
        self.sent.append(msg)
        if self.on_send is not None and self.on_send(msg):
            self.gone.set()

    @property
    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": self.path,
                "raw_path": self.path.encode(), "query_string": b"", "root_path": "",
                "headers": self.headers, "client": ("127.0.0.1", 1),
                "server": ("127.0.0.1", 80)}

    def __call__(self, app):
        """The app's coroutine for this conversation."""
        return app(self.scope, self.receive, self.send)

    def statuses(self) -> list[int]:
        return [m["status"] for m in self.sent if m["type"] == "http.response.start"]
