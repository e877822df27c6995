"""msgpack encode/decode of `Message` with a hard frame cap.

Decoding validates types and bounds against the schema; anything else is a
`FrameError` with a message fit for the peer, never an exception that could
take a server loop down. Schemas only: nothing received is ever executed.
"""

from __future__ import annotations

from typing import Callable

import msgspec

from proto.errors import ProtoError
from proto.messages import Message

DEFAULT_MAX_FRAME_BYTES = 64 << 20


class FrameError(ProtoError, ValueError):
    """A frame that is too large, not msgpack, or not a known message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Codec:
    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        # msgspec's own encode, not a method around it: a Python call less on every message sent.
        self.encode: Callable[[Message], bytes] = msgspec.msgpack.Encoder().encode
        self._decoder = msgspec.msgpack.Decoder(Message)

    def decode(self, frame: bytes | memoryview) -> Message:
        if len(frame) > self.max_frame_bytes:
            raise FrameError(
                "frame_too_large",
                f"frame of {len(frame)} bytes exceeds the {self.max_frame_bytes}-byte cap",
            )
        try:
            return self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            raise FrameError("invalid_message", f"invalid message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise FrameError("malformed_frame", f"malformed frame: {exc}") from None
