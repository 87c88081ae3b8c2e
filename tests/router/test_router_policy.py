"""Pure parts of the router: the pick policy, the non-stream merge, the flags."""

from __future__ import annotations

import pytest

from mtpserve.router.backends import DECODE, Backend, BackendPool
from mtpserve.router.config import parse_args
from mtpserve.router.merge import merge_bodies


def _picked(pool: BackendPool) -> Backend:
    backend = pool.pick()
    assert backend is not None, "no healthy backend"
    return backend


def _pool(num: int) -> BackendPool:
    pool = BackendPool(DECODE, tuple(f"http://h:{i}" for i in range(num)))
    for backend in pool.backends:
        backend.mark_healthy()
    return pool


def test_pick_least_in_flight():
    pool = _pool(3)
    pool.backends[0].in_flight, pool.backends[1].in_flight, pool.backends[2].in_flight = 2, 0, 1
    assert pool.pick() is pool.backends[1]


def test_ties_go_round_robin_and_unhealthy_are_skipped():
    pool = _pool(3)
    assert [_picked(pool).url[-1] for _ in range(6)] == list("012012")
    pool.backends[1].mark_unhealthy("down")
    assert [_picked(pool).url[-1] for _ in range(4)] == list("0202")
    for backend in pool.backends:
        backend.mark_unhealthy("down")
    assert pool.pick() is None


def test_merge_completion_shifts_offsets_from_any_base():
    first = {"id": "p", "object": "text_completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": "Hi", "finish_reason": None,
         "logprobs": {"tokens": ["Hi"], "token_logprobs": [-1.0], "top_logprobs": [{"Hi": -1.0}], "text_offset": [0]}}]}
    rest = {"id": "d", "object": "text_completion", "created": 2, "model": "m", "usage": {"completion_tokens": 3},
            "choices": [{"index": 0, "text": " yo!", "finish_reason": "stop",
                         "logprobs": {"tokens": [" yo", "!"], "token_logprobs": [-2.0, -3.0],
                                      "top_logprobs": [{}, {}], "text_offset": [0, 3]}}]}
    merged = merge_bodies(first, rest)
    assert (merged["id"], merged["created"], merged["usage"]) == ("p", 1, {"completion_tokens": 3})
    choice = merged["choices"][0]
    assert choice["text"] == "Hi yo!" and choice["finish_reason"] == "stop"
    assert choice["logprobs"] == {"tokens": ["Hi", " yo", "!"], "token_logprobs": [-1.0, -2.0, -3.0],
                                  "top_logprobs": [{"Hi": -1.0}, {}, {}], "text_offset": [0, 2, 5]}


def test_merge_chat_without_logprobs():
    first = {"id": "p", "created": 1, "choices": [{"index": 0, "message": {"role": "assistant", "content": "A"},
                                                  "logprobs": None, "finish_reason": None}]}
    rest = {"id": "d", "created": 2, "choices": [{"index": 0, "message": {"role": "assistant", "content": "BC"},
                                                 "logprobs": None, "finish_reason": "length"}]}
    choice = merge_bodies(first, rest)["choices"][0]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "ABC"}, "logprobs": None,
                      "finish_reason": "length"}


def test_flags_over_env_over_defaults():
    env = {"MTPSERVE_ROUTER_PREFILL": "http://p:1, http://p:2", "MTPSERVE_ROUTER_DECODE": "http://d:1",
           "MTPSERVE_ROUTER_PORT": "9001", "MTPSERVE_ROUTER_STREAM_IDLE_TIMEOUT": "7"}
    config = parse_args(["--port", "9002"], env=env)
    assert config.prefill_urls == ("http://p:1", "http://p:2") and config.decode_urls == ("http://d:1",)
    assert (config.port, config.stream_idle_timeout, config.host) == (9002, 7.0, "127.0.0.1")


@pytest.mark.parametrize("argv, env", [
    (["--prefill", "http://p:1"], {}),
    (["--prefill", "p:1", "--decode", "http://d:1"], {}),
    (["--prefill", "http://p:1", "--decode", "http://d:1", "--health-interval", "0"], {}),
    (["--prefill", "http://p:1", "--decode", "http://d:1"], {"MTPSERVE_ROUTER_PORT": "x"}),
])
def test_bad_configuration_exits_2(argv, env):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, env=env)
    assert exc.value.code == 2
