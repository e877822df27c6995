"""Compiler half of the stub: refuses to compile, points at TRITON_INTERPRET."""

from triton.backends.compiler import BaseBackend, GPUTarget

_HINT = (
    "triton-cpu-stub cannot compile Triton kernels; set TRITON_INTERPRET=1 so "
    "they run in Triton's interpreter."
)


class CPUStubBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "triton-cpu-stub-0.1.0"

    def parse_options(self, options: dict) -> object:
        raise RuntimeError(_HINT)

    def add_stages(self, stages: dict, options: object, language) -> None:
        raise RuntimeError(_HINT)

    def load_dialects(self, context) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
