"""How a codec stream is cut into chunks for a code2wav stage: the first chunk may be shorter
than the rest (vllm-omni's `initial_codec_chunk_frames`: the first audio after a frame or two),
then chunks of one size. Both the sidecar's code2wav hooks and the speech server's pipeline
count chunks here, so they agree on every chunk's frames."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkGrid:
    size: int  # frames of every chunk but the first
    initial: int = 0  # frames of the first chunk (vllm-omni's initial_codec_chunk_frames); 0: `size`

    def __post_init__(self) -> None:
        if self.size < 1 or self.initial < 0:
            raise ValueError(f"chunk frames must be >= 1 and initial chunk frames >= 0, got {self.size}, "
                             f"{self.initial}")

    @property
    def first(self) -> int:
        return self.initial or self.size

    def start(self, k: int) -> int:
        """The first frame of chunk k."""
        return 0 if k == 0 else self.first + (k - 1) * self.size

    def end(self, k: int) -> int:
        """One past chunk k's last frame, however many frames there are."""
        return self.start(k + 1)

    def count(self, frames: int) -> int:
        """Chunks of `frames` frames (the last one may be short)."""
        if frames <= 0:
            return 0
        return 1 + max(0, -(-(frames - self.first) // self.size))

    def complete(self, frames: int) -> int:
        """Chunks whose frames are all among the first `frames`."""
        return 0 if frames < self.first else 1 + (frames - self.first) // self.size

    def ready(self, k: int, frames: int, final: bool) -> bool:
        """Chunk k can be decoded: all its frames are there, or the stream is final and it has some."""
        return 0 <= k and self.start(k) < frames and (final or self.end(k) <= frames)

    def span(self, k: int, frames: int, left_context: int) -> tuple[int, int, int] | None:
        """(first, start, end) of chunk k: frames [first, end) are decoded, [start, end) are new
        (first = start - min(left_context, start)); None before the first chunk or past the last."""
        if k < 0 or self.start(k) >= frames:
            return None
        start = self.start(k)
        return start - min(left_context, start), start, min(frames, self.end(k))
