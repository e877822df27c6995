"""A local web server for a test: the files a reference URL names (vllm-omni's examples fetch theirs)."""

from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


@contextlib.contextmanager
def web_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on a port of 127.0.0.1 in a thread; yields its base URL; stopped after."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass
