"""Property: no request body, however odd, gets a 5xx; every 4xx is in OpenAI's error shape."""

import json

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from server_harness import MODEL_NAME

ODD_NUMBERS = st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=False),
                        st.sampled_from([0, -1, 1, 2**63, 2**64, 1e308, -0.0, 0.5]))
ODD_VALUES = st.one_of(ODD_NUMBERS, st.none(), st.booleans(), st.text(max_size=8),
                       st.lists(st.integers(min_value=-5, max_value=2**33), max_size=4),
                       st.lists(st.text(max_size=3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                                  max_size=2))
def ints(lo: int, hi: int):
    """Integers with the bounds themselves drawn often (hypothesis favours small values)."""
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi]))


VALID = {
    "max_tokens": ints(1, 8), "max_completion_tokens": ints(1, 8),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": ints(-1, 2**70),
    "min_p": st.floats(0, 1), "seed": ints(-2**63, 2**63 - 1), "n": ints(1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "stop_token_ids": st.lists(ints(0, 1000)),
    "ignore_eos": st.booleans(), "min_tokens": ints(0, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.01, 10),
    "echo": st.booleans(), "user": st.text(max_size=5), "model": st.just(MODEL_NAME),
}
PROMPTS = st.one_of(st.text(max_size=20), st.lists(st.integers(min_value=-3, max_value=5000), max_size=5),
                    st.lists(st.text(max_size=5), max_size=3), st.just([[1, 2], [3]]), ODD_VALUES)
BY_PATH = {"/v1/completions": {"logprobs": ints(0, 20)},
           "/v1/chat/completions": {"logprobs": st.just(True), "top_logprobs": ints(0, 20)}}


def body_strategy(path: str):
    """A valid body with one to three fields replaced, each by a valid or an odd value, so bodies get
    past the first check and reach the later ones (sampling params, the engine message) too."""
    valid = VALID | BY_PATH[path]
    field = st.sampled_from(sorted(valid)).flatmap(lambda f: st.tuples(st.just(f), st.one_of(valid[f], ODD_VALUES)))
    prompt = st.one_of(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20), PROMPTS)
    return st.builds(lambda p, kv: {"prompt": p, "model": MODEL_NAME, "max_tokens": 3, **dict(kv)},
                     prompt, st.lists(field, min_size=1, max_size=3))


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_no_body_gets_a_server_error(fake_server, session, path):
    base_url, _ = fake_server
    bodies = []

    # NOTE: derandomized, and 400: drawn afresh each run, 200 bodies held as few as 7 the server accepts
    # (one CI run), under the 10 that show the success path was exercised
    @settings(max_examples=400, deadline=None, database=None, derandomize=True,
              suppress_health_check=[h for h in HealthCheck if isinstance(h, HealthCheck)])
    @given(body_strategy(path))
    def collect(body):
        if path.endswith("chat/completions"):
            body = {k: v for k, v in body.items() if k != "prompt"} | {
                "messages": [{"role": "user", "content": str(body["prompt"])[:20]}]}
        bodies.append(body)

    collect()
    statuses = []
    for body in bodies:
        body.pop("stream", None)
        async with session.post(base_url + path, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
            got = await r.json()
            assert r.status < 500, (body, got)
            statuses.append(r.status)
            if r.status >= 400:
                assert set(got["error"]) == {"message", "type", "param", "code"}, got
            else:
                assert got["model"] == MODEL_NAME
    assert statuses.count(200) >= 10 and statuses.count(400) >= 10, statuses  # both paths were exercised


EXTREMES = [None, True, False, 0, -1, 1, 2, 21, 2**31, 2**63 - 1, 2**63, 2**64, 2**70, -2**63, -2**70, 0.5, -0.5,
            1e308, -1e308, 3.0, "", "x", [], [0], [2**70], [""], ["a"] * 100, {}, {"a": 1}]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_every_field_at_every_extreme(fake_server, session, path):
    """Deterministic sweep: a valid body with one field set to each extreme value."""
    base_url, _ = fake_server
    base = {"model": MODEL_NAME, "max_tokens": 3}
    base |= {"prompt": "x = 1"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    statuses = []
    for field in [*VALID, "logprobs", "top_logprobs", "stream", "prompt", "messages"]:
        for value in EXTREMES:
            body = base | {field: value}
            async with session.post(base_url + path, json=body) as r:
                got = await r.json() if r.content_type == "application/json" else await r.text()
                assert r.status < 500, (body, got)
                statuses.append(r.status)
    assert statuses.count(200) >= 20 and statuses.count(400) >= 100
