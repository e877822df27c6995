"""A `cpu` Triton backend that compiles nothing.

vLLM's CPU build enables Model Runner V2 only when Triton reports a `cpu`
backend (``vllm/triton_utils/importing.py``), and PyPI's Triton ships none.
With ``TRITON_INTERPRET=1`` every kernel runs in Triton's Python interpreter,
so the backend only has to exist and answer the driver's questions; any
attempt to really compile raises a clear error.
"""
