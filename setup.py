"""Packaging hook: ship the CUDA sources inside the package.

Everything else is in pyproject.toml.  The CUDA kernels live in ``src_cuda/``
(built by ``make -C src_cuda`` in a checkout); a wheel or sdist install has no
checkout, so ``build_py`` copies the sources into ``hybridkv/transfer/cuda/``,
where :mod:`hybridkv.transfer.cuda_kernel` finds them and builds the library
with the machine's nvcc on first use.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CUDA_SOURCES = ("page_copy.cu", "hkv_transfer_cuda.h")


class BuildPyWithCuda(build_py):
    def run(self) -> None:
        super().run()
        here = Path(__file__).resolve().parent
        target = Path(self.build_lib) / "hybridkv" / "transfer" / "cuda"
        target.mkdir(parents=True, exist_ok=True)
        for name in CUDA_SOURCES:
            self.copy_file(str(here / "src_cuda" / name), str(target / name))


setup(cmdclass={"build_py": BuildPyWithCuda})
