"""Counter-based random numbers: a uniform per (request seed, output index, purpose).

Every random draw of a request is a pure function of its own seed and of the output position it
decides, so a seeded request samples the same tokens whatever its batch neighbours are, whichever step
the position lands in, and after a recompute. It also needs no generator state on the device.
NOTE: values are uint32 held in int64 tensors; products wrap modulo 2**64 and the mask keeps the low
32 bits, which is exactly uint32 arithmetic.
"""

from __future__ import annotations

import enum

import numpy as np
import paddle

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


class Purpose(enum.IntEnum):
    SAMPLE = 0  # the token emitted at a position (plain, bonus or recovered)
    ACCEPT = 1  # the coin that accepts or rejects a draft at a position
    SYNTHETIC = 2  # synthetic-device draws (draft correctness)


def seed_to_key(seed: np.ndarray | int) -> np.ndarray:
    """Host side, once per request: splitmix64 finaliser of a 64-bit seed, folded to 32 bits."""
    with np.errstate(over="ignore"):
        z = np.asarray(seed, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z ^ (z >> np.uint64(32))) & np.uint64(_MASK32)).astype(np.int64)


def _shift(h: paddle.Tensor, bits: int) -> paddle.Tensor:
    return paddle.floor_divide(h, paddle.full([], 1 << bits, dtype="int64"))


def _fmix32(h: paddle.Tensor) -> paddle.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection with full avalanche."""
    h = paddle.bitwise_xor(h, _shift(h, 16))
    h = paddle.bitwise_and(h * 0x85EBCA6B, paddle.full([], _MASK32, dtype="int64"))
    h = paddle.bitwise_xor(h, _shift(h, 13))
    h = paddle.bitwise_and(h * 0xC2B2AE35, paddle.full([], _MASK32, dtype="int64"))
    return paddle.bitwise_xor(h, _shift(h, 16))


def uniforms(keys: paddle.Tensor, index: paddle.Tensor, purpose: Purpose) -> paddle.Tensor:
    """keys: int64 (from seed_to_key), index: int64 output positions, same shape -> float32 in (0, 1).

    NOTE: 24 random bits centred in their cell, so a uniform is never exactly 0 or 1.
    """
    mask = paddle.full([], _MASK32, dtype="int64")
    counter = paddle.bitwise_and(index * 4 + int(purpose) + _GOLDEN32, mask)
    h = _fmix32(paddle.bitwise_xor(keys, _fmix32(counter)))
    h = _fmix32(paddle.bitwise_and(h + keys * 5, mask))
    return (_shift(h, 8).astype("float32") + 0.5) * (1.0 / (1 << 24))


def uniforms_host(keys: np.ndarray, index: np.ndarray, purpose: Purpose) -> np.ndarray:
    """`uniforms` on host arrays, the same bits: the CPU step's sampler (spec_verify.sample_and_verify) needs
    a few per row, where `uniforms`' ~30 Paddle calls took ~0.3 ms a step on a 2-core host."""
    mask = np.uint64(_MASK32)
    counter = (index.astype(np.uint64) * np.uint64(4) + np.uint64(int(purpose) + _GOLDEN32)) & mask
    k = keys.astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _fmix32_host(k ^ _fmix32_host(counter))
        h = _fmix32_host((h + k * np.uint64(5)) & mask)
    return ((h >> np.uint64(8)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 24))


def _fmix32_host(h: np.ndarray) -> np.ndarray:
    mask = np.uint64(_MASK32)
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & mask
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & mask
    return h ^ (h >> np.uint64(16))
