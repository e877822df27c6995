"""The one name vllm-omni's utils/audio.py imports; see __init__.py."""


def melscale_fbanks(*args: object, **kwargs: object) -> object:
    raise NotImplementedError("torchaudio is stood in for the CPU tests (tests/support/torchaudio_stub)")
