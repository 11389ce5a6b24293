"""The service's access log: one line per request, written off the event loop."""

import atexit
import logging
import queue
import sys
import threading
import time

access = logging.getLogger("privalign.access")


class AccessLog:
    """ASGI middleware: one line per request on the ``privalign.access`` logger (stderr unless a
    logging config says otherwise): method, path, status, latency, request id, tenant, budget,
    epsilon charged and the request's OpenAI ``user``. Routes put the last five in ``request.state``;
    values not known yet (a refusal before the ledger) are ``-``. The event loop only appends a
    tuple to a queue; a writer thread makes the log record and writes it, so logging never blocks
    (or slows) request handling."""

    def __init__(self, app):
        self.app = app
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._write, daemon=True, name="privalign-access-log").start()
        atexit.register(self._drain)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            st = scope.get("state") or {}
            self.queue.put_nowait((scope["method"], scope["path"], status[0], 1000 * (time.perf_counter() - t0),
                                   st.get("request_id", "-"), st.get("tenant", "-"), st.get("budget", "-"),
                                   st.get("epsilon", "-"), st.get("user", "-")))

    def _write(self):
        while True:
            self._log(self.queue.get())

    def _drain(self):
        """Write what is still queued when the process exits."""
        while True:
            try:
                self._log(self.queue.get_nowait())
            except queue.Empty:
                return

    @staticmethod
    def _log(fields):
        access.info("%s %s %d %.1fms request_id=%s tenant=%s budget=%s epsilon=%s user=%s", *fields)


def _access_to_stderr():
    """The access log's default destination: stderr, one timestamped line per request."""
    if not access.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
