"""Build and install mtpserve.

The Python packages map onto the fixed top-level layout:
  daemon/  -> mtpserve          (CLI, HTTP process, rank processes, model)
  ipc/     -> mtpserve.ipc      (wire format, transports, readers)
  config/  -> mtpserve.config   (the configuration tree)
The C++ sources under ops_ext/ are compiled by paddle.utils.cpp_extension into one shared library,
mtpserve/_ops.so, which mtpserve.ops registers with Paddle at run time. CUDA sources (*.cu) are
compiled only when the installed Paddle is compiled with CUDA.

Paddle must already be installed (pip install --no-build-isolation), because the build links
against it; the Makefile does this in the right order.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def op_sources() -> list[str]:
    import paddle

    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "ops_ext").glob("*.cc"))
    if paddle.is_compiled_with_cuda():
        sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "ops_ext").glob("*.cu"))
    return sources


def op_extension():
    import paddle
    from paddle.utils.cpp_extension import CppExtension, CUDAExtension

    make = CUDAExtension if paddle.is_compiled_with_cuda() else CppExtension
    # NOTE: -fno-trapping-math lets GCC vectorise loops with a floor or a select (the kernels' exp and
    # silu); nothing here reads floating-point exception flags. It does not reorder arithmetic.
    flags = ["-O3", "-std=c++17", "-fno-trapping-math", "-Wall", "-Wno-unused-function"]
    if paddle.is_compiled_with_cuda():
        flags = {"cxx": flags, "nvcc": ["-O2", "-DMTPSERVE_WITH_CUDA"]}
    return make(
        name="mtpserve._ops",
        sources=op_sources(),
        include_dirs=[str(ROOT / "ops_ext")],
        extra_compile_args=flags,
        extra_link_args=["-lrt"],
    )


def build_ext_class():
    from paddle.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(no_python_abi_suffix=True)


setup(
    name="mtpserve",
    version="0.1.0",
    description="Serving daemon for language models with multi-token-prediction layers",
    python_requires=">=3.11",
    package_dir={"mtpserve": "daemon", "mtpserve.ipc": "ipc", "mtpserve.config": "config"},
    packages=["mtpserve", "mtpserve.ipc", "mtpserve.config"]
    + [f"mtpserve.{p.parent.relative_to(ROOT / 'daemon').as_posix().replace('/', '.')}"
       for p in sorted((ROOT / "daemon").glob("*/**/__init__.py"))],
    package_data={"mtpserve.config": ["*.toml"], "mtpserve": ["default_model/*"]},
    ext_modules=[op_extension()],
    cmdclass={"build_ext": build_ext_class()},
    entry_points={"console_scripts": ["mtpserve = mtpserve.cli:main"]},
)
