"""KV layout: buffer order, layout figures, compatibility, coalesced read descriptors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_peer import PeerSpec, allocate
from mtpserve.ipc import request_channel as rc
from mtpserve.pd.kv_layout import check_compatible, kv_buffers, layout_of, read_descriptors, regions_of

SPEC = PeerSpec(layers=3, depths=2, num_blocks=6, block_size=4, kv_heads=2, head_dim=8, fill_blocks=[], seed=0)


def test_layout_module_loads_neither_paddle_nor_mooncake():
    """The HTTP process may check layouts (400 on a foreign one); it never imports paddle."""
    probe = ("import sys, mtpserve.pd.kv_layout, mtpserve.pd.kv_transfer\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'paddle', 'mooncake'}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_buffers_in_contract_order_each_depth_once():
    main, depths = allocate(SPEC)
    buffers = kv_buffers(main, depths)
    expected = [main.k[0], main.v[0], main.k[1], main.v[1], main.k[2], main.v[2],
                depths[0].k[0], depths[0].v[0], depths[1].k[0], depths[1].v[0]]
    assert len(depths[0].k) == 2 and depths[0].k[1] is depths[0].k[0]  # shared, as the runner builds it
    assert [id(t) for t in buffers] == [id(t) for t in expected]


def test_a_shared_k_and_v_tensor_is_exposed_once():
    """MLA's latent cache (one tensor per layer is both K and V) is read once, not twice."""
    from mtpserve.model.kv_cache import KVCache

    main = KVCache.allocate(2, 4, 8, 1, 6, shared_kv=True)
    depth = KVCache.allocate(1, 4, 8, 1, 6, shared_kv=True)
    assert [id(t) for t in kv_buffers(main, [depth])] == [id(main.k[0]), id(main.k[1]), id(depth.k[0])]


def test_depth_with_distinct_layer_tensors_is_refused():
    main, depths = allocate(SPEC)
    other = allocate(dataclasses.replace(SPEC, layers=2))[0]
    with pytest.raises(ValueError, match="MTP depth 0 K"):
        kv_buffers(main, [dataclasses.replace(depths[0], k=other.k)])


def test_layout_and_regions_match_the_tensors():
    main, depths = allocate(SPEC)
    buffers = kv_buffers(main, depths)
    layout = layout_of(buffers, SPEC.block_size)
    row_bytes = SPEC.kv_heads * SPEC.head_dim * 4  # float32
    assert layout.block_size == SPEC.block_size
    assert layout.buffer_addrs == [t.data_ptr() for t in buffers]
    assert layout.block_bytes == [SPEC.block_size * row_bytes] * len(buffers)
    assert regions_of(buffers) == [(t.data_ptr(), (SPEC.num_blocks + 1) * SPEC.block_size * row_bytes)
                                   for t in buffers]


def _layout(n: int = 4, block_size: int = 16, block_bytes: int = 512) -> rc.KVLayout:
    return rc.KVLayout(block_size=block_size, buffer_addrs=[(i + 1) << 20 for i in range(n)],
                       block_bytes=[block_bytes] * n)


@pytest.mark.parametrize("remote, what", [(_layout(n=6), "buffers"), (_layout(block_size=32), "block_size"),
                                          (_layout(block_bytes=1024), "block_bytes")])
def test_incompatible_layouts_are_refused(remote, what):
    with pytest.raises(ValueError, match=what):
        check_compatible(_layout(), remote)
    with pytest.raises(ValueError, match=what):
        read_descriptors(_layout(), [0], remote, [0])


def test_mismatched_or_negative_block_lists_are_refused():
    with pytest.raises(ValueError):
        read_descriptors(_layout(), [0, 1], _layout(), [0])
    with pytest.raises(ValueError):
        read_descriptors(_layout(), [-1], _layout(), [0])


# ---- descriptors against a per-block reference, on simulated memory -------------------------------

NUM_BLOCKS = 12


@st.composite
def transfers(draw):
    """Two layouts over one simulated address space (buffers at arbitrary offsets, per-buffer
    block sizes) and paired block lists, biased towards runs."""
    num_buffers = draw(st.integers(1, 4))
    block_bytes = draw(st.lists(st.sampled_from([1, 4, 12]), min_size=num_buffers, max_size=num_buffers))
    local, remote = (_random_layout(draw, block_bytes) for _ in range(2))
    n = draw(st.integers(0, NUM_BLOCKS))
    local_blocks = _ids_with_runs(draw, n)
    remote_blocks = _ids_with_runs(draw, n)
    return local, local_blocks, remote, remote_blocks


def _random_layout(draw, block_bytes: list[int]) -> rc.KVLayout:
    """Buffers of NUM_BLOCKS blocks, placed in order with random gaps (addresses = byte offsets)."""
    addrs, at = [], 0
    for bb in block_bytes:
        at += draw(st.integers(0, 7))
        addrs.append(at)
        at += NUM_BLOCKS * bb
    return rc.KVLayout(block_size=4, buffer_addrs=addrs, block_bytes=block_bytes)


def _ids_with_runs(draw, n: int) -> list[int]:
    """n distinct block ids: a shuffle of 0..NUM_BLOCKS-1, or (often) a mostly sorted one."""
    ids = draw(st.permutations(range(NUM_BLOCKS)))[:n]
    return sorted(ids) if draw(st.booleans()) else list(ids)


def per_block_reference(local, local_blocks, remote, remote_blocks):
    """One copy per (buffer, block), no coalescing."""
    out = []
    for i, bb in enumerate(local.block_bytes):
        for lb, rb in zip(local_blocks, remote_blocks):
            out.append((local.buffer_addrs[i] + lb * bb, remote.buffer_addrs[i] + rb * bb, bb))
    return out


def apply(copies, remote_memory: np.ndarray, size: int) -> np.ndarray:
    local_memory = np.zeros(size, dtype=np.int64)
    for dst, src, n in copies:
        local_memory[dst:dst + n] = remote_memory[src:src + n]
    return local_memory


@settings(max_examples=300, deadline=None)
@given(transfers())
def test_coalesced_descriptors_move_the_same_bytes_as_per_block_copies(case):
    local, local_blocks, remote, remote_blocks = case
    desc = read_descriptors(local, local_blocks, remote, remote_blocks)
    size = max(local.buffer_addrs[-1], remote.buffer_addrs[-1]) + NUM_BLOCKS * max(local.block_bytes)
    remote_memory = np.arange(1, size + 1)  # every byte distinct and non-zero
    expected = apply(per_block_reference(local, local_blocks, remote, remote_blocks), remote_memory, size)
    got = apply(zip(desc.local_addrs, desc.remote_addrs, desc.lengths), remote_memory, size)
    np.testing.assert_array_equal(got, expected)
    assert all(isinstance(x, int) for x in desc.local_addrs + desc.remote_addrs + desc.lengths)


@settings(max_examples=300, deadline=None)
@given(transfers())
def test_one_descriptor_per_buffer_per_run(case):
    """Maximal coalescing: a list neighbour merges exactly when both its ids continue the run."""
    local, local_blocks, remote, remote_blocks = case
    desc = read_descriptors(local, local_blocks, remote, remote_blocks)
    breaks = sum(1 for j in range(1, len(local_blocks))
                 if local_blocks[j] != local_blocks[j - 1] + 1 or remote_blocks[j] != remote_blocks[j - 1] + 1)
    runs = (breaks + 1) if local_blocks else 0
    assert len(desc.lengths) == len(local.block_bytes) * runs
    assert sum(desc.lengths) == len(local_blocks) * sum(local.block_bytes)


# ---- the engine's own KV: what a prefill rank registers stays where it was --------------------------

def test_engine_steps_write_kv_in_place_at_the_registered_addresses():
    """Registration happens once at start; every later KV write (prefill, decode, MTP depths) must
    land in the same memory, or a decode rank would read stale bytes."""
    import paddle

    from mtpserve.engine.engine_core import CoreConfig, EngineCore
    from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
    from mtpserve.engine.request import EngineRequest, SamplingParams
    from mtpserve.engine.scheduler import SchedulerConfig
    from mtpserve.model.config import ModelConfig
    from mtpserve.model.mimo_model import MiMoForCausalLM

    paddle.seed(0)
    model = MiMoForCausalLM(ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=2, num_nextn_predict_layers=2))
    model.eval()
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_prefill_chunk=16,
                            num_speculative_tokens=2, num_blocks=32, block_size=8)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=4, num_blocks=32, block_size=8,
                                                        num_speculative_tokens=2))
    proposer = runner.proposer
    assert proposer is not None
    buffers = kv_buffers(runner.kv, proposer.kv)
    before = layout_of(buffers, 8)
    # NOTE: every step drafts 2, so both MTP depths write (an untrained model's drafts would make the
    # adaptive policy skip them)
    core = EngineCore(CoreConfig(sched, adaptive_speculation=False), runner)
    for i in range(3):
        core.add_request(EngineRequest(f"r{i}", tuple(range(1 + i, 30 + i)), SamplingParams(max_tokens=8)))
    while core.has_unfinished_requests():
        core.step()
    core.close()
    assert len(buffers) == 2 * 2 + 2 * 2
    assert layout_of(kv_buffers(runner.kv, proposer.kv), 8) == before
    assert before.buffer_addrs == [t.data_ptr() for t in buffers]
    assert all(np.abs(t.numpy()[:-8]).sum() > 0 for t in buffers)  # every buffer was written (not scratch)
