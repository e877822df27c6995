"""A stand-in for torchaudio, on sys.path only for the tests that import vllm-omni's talker.

No torchaudio build exists for the CPU torch these tests run (torch 2.13.0+cpu; PyPI's
torchaudio wheels pull a CUDA torch), and vllm-omni's `utils/audio.py` imports
`torchaudio.functional.melscale_fbanks` at import time; its mel filters are written here (functional.py)
for the voice-cloning tests, whose speaker encoder reads a mel spectrogram of the reference audio.
"""
