"""mtpserve: a serving daemon for language models with multi-token-prediction layers."""

from mtpserve.cpu_math import prefer_avx2_mkl_on_amd

__version__ = "0.1.0"

# WHY here: every entry point (CLI, ranks, tests, benchmarks) imports the package before Paddle, and
# MKL reads the variable when it loads.
prefer_avx2_mkl_on_amd()
