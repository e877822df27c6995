"""Limits and defaults both sides share, and the environment variables that set them.

One place for every value the shim and the sidecar must agree on (or that an
operator sets once for both); each side's own settings live in its config
module and take their defaults from here.
"""

from __future__ import annotations

from typing import Final

ENV_PREFIX: Final = "OMNI_SIDECAR_"
ENV_ENDPOINT: Final = "OMNI_SIDECAR_ENDPOINT"
ENV_RING: Final = "OMNI_SIDECAR_RING"
ENV_RING_SPIN_US: Final = "OMNI_SIDECAR_RING_SPIN_US"
ENV_RING_SLEEP_MS: Final = "OMNI_SIDECAR_RING_SLEEP_MS"
ENV_RING_KIB: Final = "OMNI_SIDECAR_RING_KIB"

# Shared-memory ring fast path: poll (yielding the CPU) this long after the last
# message, then sleep on the socket for at most RING_SLEEP_MS between re-checks.
RING_SPIN_US: Final = 2000
RING_SLEEP_MS: Final = 2
RING_SLEEP_MS_MAX: Final = 1000
# After this long without traffic the sidecar's sleeps stretch to RING_IDLE_SLEEP_MS.
RING_IDLE_S: Final = 1.0
RING_IDLE_SLEEP_MS: Final = 50

# ZMTP heartbeats on every connection: a peer that stops answering (SIGSTOP, a hung
# host, a container whose process is gone) is disconnected within the timeout.
HEARTBEAT_IVL_MS: Final = 1000
HEARTBEAT_TIMEOUT_MS: Final = 3000

# Error texts that cross the wire are cut to this many characters.
ERROR_TEXT_MAX: Final = 4000
# Per-step timings the shim keeps for its stats (exchange, StepEnd, model hooks): the latest this
# many; a server running for days must not grow a list per step.
TIMINGS_KEPT: Final = 10_000
RING_KIB: Final = 1024  # each direction's ring, per connection

# Hot upgrade of a session between steps (docs/ARCHITECTURE.md, Hot upgrade): the sidecar hands
# it over on its own once it was this long between steps; a shim that sent nothing for
# STEP_START_ANSWER_S waits at its next step for the sidecar to answer its StepStart. The
# difference is the margin for a message written before the sidecar looked but not yet read.
IDLE_HANDOVER_S: Final = 0.4
STEP_START_ANSWER_S: Final = 0.1

# Generation-only code2wav stage (omni_sidecar/hook_sets/omni/code2wav.py): codec frames decoded per step,
# and previous frames decoded with each chunk whose samples are cut off (vllm-omni's defaults).
CODE2WAV_CHUNK_FRAMES: Final = 25
CODE2WAV_LEFT_CONTEXT_FRAMES: Final = 25
# A voice-cloning talker's outputs (vllm-omni's names): its reference audio's codes [frames, Q] and
# their length, which the code2wav stage decodes before the answer's frames.
REF_CODES: Final = "codes.ref"
REF_CODE_LEN: Final = "meta.ref_code_len"
