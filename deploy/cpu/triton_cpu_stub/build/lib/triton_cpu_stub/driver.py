"""Driver half of the stub: always active, targets the host CPU."""

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class CPUStubDriver(DriverBase):
    def __init__(self) -> None:
        self.target = GPUTarget("cpu", 0, 0)

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_benchmarker(self):
        import time

        def bench(fn, *args, **kwargs):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return bench
