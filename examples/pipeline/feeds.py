"""One request's input as a stage receives it from the previous stage's sidecar.

A `Feed` follows one request of the previous stage (`SidecarClient.poll`, no waiting): the
rows it produced so far under one output name, and whether it has ended. The stage driver
then tells, per request, whether its next engine step has what it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from omni_sidecar.client import SidecarClient


ALL_SEEN = 1 << 40  # a cursor past every chunk (the largest one the protocol carries): asks only whether the request is known


@dataclass
class Feed:
    req_id: str  # this stage's request
    output: str  # the previous stage's output that this stage reads, e.g. "hidden_states"
    source_id: str = ""  # the previous stage's request (default: the same id)
    rows: list[torch.Tensor] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)  # its non-row outputs (latest)
    cursor: int = 0
    ended: bool = False  # the previous stage finished this request: no more rows
    added: bool = False  # this stage's request exists
    sent: int = 0  # rows handed to this stage's request so far
    generated: int = 0  # this stage's tokens so far (its steps past the prompt)
    finished: bool = False  # this stage's request finished
    admitted: bool = False  # this stage's sidecar knows the request (its first step began): appends go in

    def admitted_by(self, own: SidecarClient) -> bool:
        """vLLM hands a request to the sidecar with the first step that schedules it; before that,
        an append would be refused as unknown."""
        if not self.admitted:
            self.admitted = own.poll(self.req_id, ALL_SEEN).found
        return self.admitted

    def pull(self, client: SidecarClient) -> None:
        if self.ended:
            return
        got = client.poll(self.source_id or self.req_id, self.cursor)
        self.cursor = got.cursor
        for chunk in got.chunks:
            rows = chunk.get(self.output)
            if isinstance(rows, torch.Tensor) and rows.shape[0]:
                self.rows.append(rows)
            self.values.update({k: v for k, v in chunk.items() if not isinstance(v, torch.Tensor)})
        self.ended = got.finished

    @property
    def count(self) -> int:
        return sum(int(r.shape[0]) for r in self.rows)

    def all_rows(self) -> torch.Tensor:
        return torch.cat(self.rows) if len(self.rows) != 1 else self.rows[0]

    @property
    def live(self) -> bool:
        return self.added and not self.finished


def pull_all(feeds: list[Feed], client: SidecarClient) -> bool:
    """Whether anything new came in."""
    before = [(f.count, f.ended) for f in feeds]
    for feed in feeds:
        feed.pull(client)
    return before != [(f.count, f.ended) for f in feeds]


def describe(feeds: list[Feed]) -> str:
    """Where each request stands: for the error of a stage that stalled."""
    return "; ".join(f"{f.req_id}: {f.count} {f.output} rows in ({f.values.get('prompt_len', '?')} prompt), "
                     f"input {'ended' if f.ended else 'open'}, {'added' if f.added else 'not added'}, "
                     f"{f.sent} sent, {f.generated} generated{', finished' if f.finished else ''}"
                     for f in feeds)


def wait_ended(feeds: list[Feed], client: SidecarClient, poll_s: float, timeout_s: float = 600.0) -> None:
    """By hand: wait until the previous stage finished every request (its whole output there)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not all(f.ended for f in feeds):
        if time.monotonic() > deadline:
            missing = [f.req_id for f in feeds if not f.ended]
            raise TimeoutError(f"the previous stage did not finish {missing} within {timeout_s:.0f}s")
        pull_all(feeds, client)
        time.sleep(poll_s)


def note_outputs(feeds: dict[str, Feed], outs: list[Any]) -> list[str]:
    """Record this stage's engine outputs; the ids that finished in this step."""
    done = []
    for out in outs:
        feed = feeds[out.request_id]
        feed.generated = len(out.outputs[0].token_ids)
        if out.finished:
            feed.finished = True
            done.append(out.request_id)
    return done
