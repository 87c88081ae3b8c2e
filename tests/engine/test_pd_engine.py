"""PD through the KV connectors, two real engines in one process: a prefill core's connector holds the
prompt's KV, its blocks are copied into a decode core (here by numpy; across processes Mooncake reads
them), and the decode core continues. Greedy output and first-token logprobs must equal one mixed
engine's. The connectors' reads and announcements are recorded instead of sent."""

import time

import numpy as np
import pytest

from mtpserve.engine import mtp_window
from mtpserve.engine.engine_core import EngineCore
from mtpserve.engine.kv_decode import DecodeConnector, KVFetch
from mtpserve.engine.kv_prefill import KVHold, PrefillConnector
from mtpserve.engine.request import EngineRequest, FinishReason, RemoteKV, SamplingParams
from test_model_runner import drafty_model, make_core, prompts

K = 2
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def model():
    return drafty_model()


def buffers(core: EngineCore) -> list:
    """The runner's KV tensors in docs/pd.md's order."""
    runner = core.runner
    main = [t for pair in zip(runner.kv.k, runner.kv.v) for t in pair]
    depths = [t for d in (runner.proposer.kv if runner.proposer else []) for t in (d.k[0], d.v[0])]
    return main + depths


def copy_blocks(src: EngineCore, src_blocks, dst: EngineCore, dst_blocks) -> None:
    bs = src.scheduler.config.block_size
    rows = lambda blocks: np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in blocks])  # noqa: E731
    for s, d in zip(buffers(src), buffers(dst), strict=True):
        data = d.numpy()
        data[rows(dst_blocks)] = s.numpy()[rows(src_blocks)]
        d.set_value(data)


def drain(core: EngineCore, outs: dict, extra: dict | None = None) -> None:
    while core.has_unfinished_requests():
        out = core.step()
        for i, rid in enumerate(out.request_ids):
            entry = outs.setdefault(rid, {"tokens": [], "logprobs": [], "reason": 0, "drafts": None})
            entry["tokens"] += out.tokens_of(i).tolist()
            entry["reason"] = int(out.finish_reasons[i])
            if out.token_logprobs is not None and out.num_tokens[i]:
                start = int(out.num_tokens[:i].sum())
                entry["logprobs"] += out.token_logprobs[start:start + int(out.num_tokens[i])].tolist()
            if out.drafts is not None:
                entry["drafts"] = out.drafts[i].tolist()
            if out.handoff is not None:
                entry["handoff"] = bool(out.handoff[i])  # goes out as a FIRST_TOKEN frame


def params(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)


def prefill_core(model, lease_s=30.0, **options) -> tuple[EngineCore, list[KVHold]]:
    announced: list[KVHold] = []
    return make_core(model, K, connector=PrefillConnector(lease_s, announced.append), **options), announced


def decode_core(model, **options) -> tuple[EngineCore, DecodeConnector, list[KVFetch]]:
    reads: list[KVFetch] = []
    connector = DecodeConnector(reads.append)
    return make_core(model, K, connector=connector, **options), connector, reads


def prefill(core, texts, announced):
    for i, p in enumerate(texts):
        core.add_request(EngineRequest(f"r{i}", p, params(1), hold_kv=True))
    outs = {}
    drain(core, outs)
    return outs, {h.request_id: h for h in announced}


def decode_requests(texts, first, deadline_s=30.0):
    return [EngineRequest(f"r{i}", p, params(), remote=RemoteKV(
        source=f"r{i}", first_token_id=first[f"r{i}"]["tokens"][0],
        draft_token_ids=tuple(first[f"r{i}"]["drafts"]), deadline=time.time() + deadline_s))
        for i, p in enumerate(texts)]


def test_prefill_then_decode_equals_mixed(model):
    texts = prompts(12, seed=3)
    mixed = make_core(model, K)
    for i, p in enumerate(texts):
        mixed.add_request(EngineRequest(f"r{i}", p, params()))
    want = {}
    drain(mixed, want)
    (p_core, announced), (d_core, conn, fetches) = prefill_core(model), decode_core(model)
    first, holds = prefill(p_core, texts, announced)
    assert set(holds) == set(first) and all(entry["handoff"] for entry in first.values())
    for request in decode_requests(texts, first):
        d_core.add_request(request)
    assert d_core.has_unfinished_requests() and not d_core.has_runnable_work()
    d_core.idle()
    assert [f.request_id for f in fetches] == [f"r{i}" for i in range(len(texts))]
    for fetch in fetches:
        copy_blocks(p_core, holds[str(fetch.source)].block_ids, d_core, fetch.block_ids)
        conn.fetched(fetch.request_id, ok=True)
    got = {}
    drain(d_core, got)
    for rid, entry in want.items():
        assert first[rid]["tokens"] + got[rid]["tokens"] == entry["tokens"], rid
        assert first[rid]["logprobs"][0] == pytest.approx(entry["logprobs"][0], abs=1e-4)
        assert got[rid]["reason"] == FinishReason.LENGTH
    assert conn.num_fallbacks == 0
    p_core.connector.release(list(holds))
    for core in (p_core, d_core):
        assert core.scheduler.blocks.num_used_blocks == 0
        core.close()
    mixed.close()


def test_failed_or_late_read_recomputes_with_the_same_output(model):
    texts = prompts(3, seed=5)
    (p_core, announced), (d_core, conn, fetches) = prefill_core(model), decode_core(model)
    first, holds = prefill(p_core, texts, announced)
    requests = decode_requests(texts, first)
    requests[2] = EngineRequest("r2", texts[2], params(), remote=RemoteKV(
        "r2", first["r2"]["tokens"][0], (), deadline=time.time() - 1))  # lease already over
    for request in requests:
        d_core.add_request(request)
    d_core.idle()
    assert [f.request_id for f in fetches] == ["r0", "r1"]
    copy_blocks(p_core, holds["r0"].block_ids, d_core, fetches[0].block_ids)
    conn.fetched("r0", ok=True)
    conn.fetched("r1", ok=False)
    got = {}
    drain(d_core, got)
    assert conn.num_fallbacks == 2
    mixed = make_core(model, K)
    for i, p in enumerate(texts):
        mixed.add_request(EngineRequest(f"r{i}", p, params()))
    want = {}
    drain(mixed, want)
    for rid in want:
        assert first[rid]["tokens"] + got[rid]["tokens"] == want[rid]["tokens"]
    assert d_core.scheduler.blocks.num_used_blocks == 0
    for core in (p_core, d_core, mixed):
        core.close()


def test_abort_during_read_frees_blocks_when_the_read_returns(model):
    texts = prompts(2, seed=7)
    (p_core, announced), (d_core, conn, fetches) = prefill_core(model), decode_core(model)
    first, _ = prefill(p_core, texts, announced)
    for request in decode_requests(texts, first):
        d_core.add_request(request)
    d_core.idle()
    used = d_core.scheduler.blocks.num_used_blocks
    assert used > 0
    assert d_core.abort_request("r0") and d_core.abort_request("r1")
    out = d_core.finish_step(None)
    assert sorted(out.request_ids) == ["r0", "r1"]
    assert d_core.scheduler.blocks.num_used_blocks == used  # the read may still write into them
    for fetch in fetches:
        conn.fetched(fetch.request_id, ok=True)
    assert d_core.scheduler.blocks.num_used_blocks == 0
    assert not d_core.has_unfinished_requests()
    for core in (p_core, d_core):
        core.close()


def test_held_kv_is_freed_by_release_abort_or_lease(model):
    core, announced = prefill_core(model)
    conn = core.connector
    assert isinstance(conn, PrefillConnector)
    texts = prompts(3, seed=9)
    _, holds = prefill(core, texts, announced)
    assert len(holds) == 3 and core.scheduler.blocks.num_used_blocks > 0
    one = len(holds["r0"].block_ids)
    conn.release(["r0", "r0"])  # the second is a no-op: never freed twice
    assert core.scheduler.blocks.num_used_blocks == sum(len(h.block_ids) for h in holds.values()) - one
    core.abort_request("r1")  # a client that left before the decode instance took it
    assert set(conn.holds) == {"r2"}
    assert conn.expire(now=time.monotonic()) == []
    assert conn.expire(now=holds["r2"].deadline + 0.001) == ["r2"]
    assert core.scheduler.blocks.num_used_blocks == 0 and conn.stats().get("num_kv_leases_expired") == 1
    core.close()


def test_a_first_token_that_stops_holds_nothing(model):
    core, announced = prefill_core(model)
    text = prompts(1, seed=11)[0]
    probe, probe_holds = prefill_core(model)
    first, _ = prefill(probe, [text], probe_holds)
    probe.close()
    stop = first["r0"]["tokens"][0]
    core.add_request(EngineRequest("r0", text, SamplingParams(temperature=0.0, max_tokens=1,
                                                              stop_token_ids=(stop,)), hold_kv=True))
    outs = {}
    drain(core, outs)
    assert outs["r0"]["reason"] == FinishReason.STOP
    assert announced == [] and core.scheduler.blocks.num_used_blocks == 0
    core.close()


def test_a_read_that_outlives_the_lease_is_abandoned_and_recomputed(model):
    texts = prompts(2, seed=13)
    (p_core, announced), (d_core, conn, fetches) = prefill_core(model), decode_core(model)
    mixed = make_core(model, K)
    first, _ = prefill(p_core, texts, announced)
    for request in decode_requests(texts, first, deadline_s=5.0):
        d_core.add_request(request)
    d_core.idle()
    reserved = d_core.scheduler.blocks.num_used_blocks
    assert len(fetches) == 2
    assert conn.abandon_stale(now=time.time()) == []
    assert sorted(conn.abandon_stale(now=time.time() + 6.0)) == ["r0", "r1"]
    got = {}
    drain(d_core, got)  # NOTE: the reads have not returned: the recompute runs in other blocks
    assert conn.num_fallbacks == 2
    assert d_core.scheduler.blocks.num_used_blocks == reserved
    for fetch in fetches:
        conn.fetched(fetch.request_id, ok=True)  # the stuck reads come back late
    assert d_core.scheduler.blocks.num_used_blocks == 0
    for i, p in enumerate(texts):
        mixed.add_request(EngineRequest(f"r{i}", p, params()))
    want = {}
    drain(mixed, want)
    for rid in want:
        assert first[rid]["tokens"] + got[rid]["tokens"] == want[rid]["tokens"]
    for core in (p_core, d_core, mixed):
        core.close()


def test_the_decode_side_drafts_from_the_prefills_key_start(model):
    """A prefill instance with a prompt window (8) hands over a 45-token prompt whose MTP KV starts at a
    block past 0; a decode instance set to whole prompts (window 0) takes that key start from the handoff,
    and its drafts, accepted exactly as often step by step, are a mixed engine's with the prefill's window.
    Without the field the decode side derives its own key start (0), reading MTP KV nobody wrote."""
    text = tuple(int(t) for t in np.random.default_rng(17).integers(1, 64, 45))
    start = mtp_window.key_start(len(text), 8, 8)
    assert start == 32

    def accepted(core, outs):
        counts = []
        while core.has_unfinished_requests():
            out = core.step()
            counts += [(int(out.num_draft_tokens[i]), int(out.num_accepted_tokens[i]))
                       for i, rid in enumerate(out.request_ids) if out.num_tokens[i] and rid == "r0"]
            for i, rid in enumerate(out.request_ids):
                outs.setdefault(rid, []).extend(out.tokens_of(i).tolist())
        return counts

    fixed = {"adaptive": False, "overlap": False}  # NOTE: a step's outputs are that step's
    mixed = make_core(model, K, prompt_window=8, **fixed)
    mixed.add_request(EngineRequest("r0", text, params()))
    want_tokens: dict = {}
    want = accepted(mixed, want_tokens)[1:]  # after the first token's step, as the decode side sees them
    (p_core, announced), (d_core, conn, fetches) = (prefill_core(model, prompt_window=8, **fixed),
                                                    decode_core(model, prompt_window=0, **fixed))
    first, holds = prefill(p_core, [text], announced)
    assert holds["r0"].mtp_key_start == start
    for said, derived in ((start, start), (None, 0)):
        d_core.add_request(EngineRequest("r0", text, params(), remote=RemoteKV(
            "r0", first["r0"]["tokens"][0], tuple(first["r0"]["drafts"]), time.time() + 30.0, mtp_key_start=said)))
        d_core.idle()
        fetch = fetches.pop()
        copy_blocks(p_core, holds["r0"].block_ids, d_core, fetch.block_ids)
        conn.fetched(fetch.request_id, ok=True)
        out = d_core.step()  # the first window: the request is in its slot now
        request = d_core.scheduler.get("r0")
        assert request is not None and request.mtp_key_start == d_core.runner.state.key_start[request.slot] == derived
        got = {"r0": out.tokens_of(0).tolist()}
        counts = accepted(d_core, got)
        assert first["r0"]["tokens"] + got["r0"] == want_tokens["r0"]
        if said is not None:
            assert counts == want[1:] and sum(n for _, n in counts) > 0
    for core in (p_core, d_core, mixed):
        core.close()
