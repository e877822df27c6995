"""A shim without vLLM: handshake with its own pid, admit one request, then wait to be killed.

Usage: python fake_shim_job.py ENDPOINT   (prints "ready" once the sidecar holds the request)
"""

from __future__ import annotations

import os
import sys
import time

from proto.endpoint import pid_namespace
from proto.messages import Hello, NewRequest, StepEnd, StatusQuery, StatusReply
from proto.packed import packed_layout
from worker_shim.wire.connection import SidecarConnection
from proto.version import PROTOCOL_MAJOR


def main(endpoint: str) -> None:
    hello = Hello(PROTOCOL_MAJOR, 0, "fake", "none", "cpu", 0, 1, "fake-model", 8, "float32", 16, [],
                  pid=os.getpid(), pid_namespace=pid_namespace())
    conn = SidecarConnection(endpoint, 10, hello, 4096, 2, arena_prefix="omni-shim-fake")
    conn.connect(10)
    conn.send(StepEnd(0, packed_layout(["req-dead"], [0, 3], [0], [3]),
                      new_requests=[NewRequest("req-dead", 3, [5, 6, 7])], num_tokens=3))
    conn.channel.take_results(until_step=0)  # the sidecar has admitted the request
    assert isinstance(conn.call(StatusQuery(), StatusReply), StatusReply)
    print("ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1])
