"""The official `openai` client against the HTTP app + fake engine: shapes, logprobs, usage, n, stop."""

import pytest
from openai import AsyncOpenAI

from server_harness import MODEL_NAME


@pytest.fixture(params=["posix", "sysv"])
def transport(request) -> str:
    return request.param


@pytest.fixture
async def client(fake_server):
    base_url, _ = fake_server
    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _expected_ids(text_model, prompt, n):
    ids = text_model.encode(prompt)
    return [ids[i % len(ids)] for i in range(n)]


async def test_completion_non_stream_with_logprobs(client, text_model):
    prompt = "def add(a, b):\n    return a + b\n"
    out = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, logprobs=5)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert choice.text == text_model.decode(_expected_ids(text_model, prompt, 12))
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == out.usage.completion_tokens == 12
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(tok in top and len(top) <= 6 for tok, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs))
    assert out.usage.prompt_tokens == len(text_model.encode(prompt))
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


async def test_completion_stream_logprobs_one_entry_per_token(client):
    stream = await client.completions.create(model=MODEL_NAME, prompt="import os\nimport sys\n", max_tokens=20,
                                             logprobs=3, stream=True, stream_options={"include_usage": True})
    texts, entries, usage, multi = [], 0, None, 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        choice = chunk.choices[0]
        texts.append(choice.text)
        if choice.logprobs is not None:
            entries += len(choice.logprobs.tokens)
            multi += len(choice.logprobs.tokens) > 1
    assert usage is not None and usage.completion_tokens == entries == 20
    assert multi > 0  # MTP: some chunks carry several tokens, each with its entry
    assert usage.model_extra["spec_decode"]["num_decode_steps"] > 0


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_top5_is_prefix_of_top10(client, stream):
    async def run(k):
        kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "print hello"}], max_tokens=10,
                      logprobs=True, top_logprobs=k, seed=7)
        if not stream:
            out = await client.chat.completions.create(**kwargs)
            return out.choices[0].logprobs.content, out.usage.completion_tokens, out.choices[0].message.content
        entries, text, usage = [], "", None
        async for chunk in await client.chat.completions.create(**kwargs, stream=True,
                                                                stream_options={"include_usage": True}):
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                entries += c.logprobs.content if c.logprobs else []
        assert usage is not None
        return entries, usage.completion_tokens, text

    top5, n5, text5 = await run(5)
    top10, n10, text10 = await run(10)
    assert len(top5) == n5 == len(top10) == n10 == 10 and text5 == text10
    for a, b in zip(top5, top10):
        assert a.token == b.token and a.logprob == b.logprob
        assert len(a.top_logprobs) == 5 and len(b.top_logprobs) == 10
        assert [(t.token, t.logprob) for t in a.top_logprobs] == [(t.token, t.logprob) for t in b.top_logprobs[:5]]
        assert a.top_logprobs[0].token == a.token  # the fake engine samples its top-1
        assert bytes(a.bytes) == a.token.encode()


async def test_chat_stream_shape(client):
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "x = 1"}],
        max_tokens=8, stream=True)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


async def test_n_and_multiple_prompts(client, text_model):
    out = await client.completions.create(model=MODEL_NAME, prompt=["alpha beta", "gamma"], n=3, max_tokens=5)
    assert sorted(c.index for c in out.choices) == list(range(6))
    for c in out.choices:
        prompt = ["alpha beta", "gamma"][c.index // 3]
        assert c.text == text_model.decode(_expected_ids(text_model, prompt, 5))
    assert out.usage.completion_tokens == 30


async def test_token_id_prompt_and_echo(client, text_model):
    ids = text_model.encode("while True:\n    pass\n")
    out = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, echo=True)
    assert out.choices[0].text.startswith("while True:\n    pass\n")
    assert out.usage.prompt_tokens == len(ids)


async def test_stop_string_split_across_tokens(client, text_model):
    prompt = "for item in items:\n    print(item)\n"
    full = text_model.decode(_expected_ids(text_model, prompt, 40))
    stop = "print(it"
    assert stop in full
    expected_text = full[:full.index(stop)]
    for stream in (False, True):
        if stream:
            text, finish, usage = "", None, None
            async for chunk in await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40,
                                                               stop=[stop], stream=True, logprobs=0,
                                                               stream_options={"include_usage": True}):
                if chunk.usage:
                    usage = chunk.usage
                for c in chunk.choices:
                    text += c.text
                    finish = c.finish_reason or finish
        else:
            out = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, stop=[stop],
                                                  logprobs=0)
            text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
            assert len(out.choices[0].logprobs.tokens) == usage.completion_tokens
        assert text == expected_text and finish == "stop" and usage is not None
        kept = text_model.decode(_expected_ids(text_model, prompt, usage.completion_tokens))
        assert stop in kept and stop not in text_model.decode(_expected_ids(text_model, prompt,
                                                                            usage.completion_tokens - 1))


async def test_stop_token_ids_and_min_tokens(client, text_model):
    ids = text_model.encode("a b c d e f")
    out = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=20,
                                          extra_body={"stop_token_ids": [ids[2]]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 3
    out = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=20,
                                          extra_body={"stop_token_ids": [ids[2]], "min_tokens": 5})
    assert out.usage.completion_tokens == len(ids) + 3


async def test_request_id_header(client):
    raw = await client.completions.with_raw_response.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id


async def test_models_tokenize_detokenize(fake_server, client, text_model):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    base_url, _ = fake_server
    import aiohttp
    async with aiohttp.ClientSession() as s:
        async with s.post(base_url + "/tokenize", json={"prompt": "hello world"}) as r:
            tok = await r.json()
        async with s.post(base_url + "/detokenize", json={"tokens": tok["tokens"]}) as r:
            detok = await r.json()
    assert tok["tokens"] == text_model.encode("hello world") and tok["count"] == len(tok["tokens"])
    assert detok["prompt"] == "hello world"


async def test_mixed_batch_logprobs_only_where_asked(client):
    import asyncio
    with_lp, without = await asyncio.gather(
        client.completions.create(model=MODEL_NAME, prompt="a = 1\nb = 2\n", max_tokens=30, logprobs=2),
        client.completions.create(model=MODEL_NAME, prompt="c = 3\n", max_tokens=30))
    assert len(with_lp.choices[0].logprobs.tokens) == 30
    assert without.choices[0].logprobs is None


async def test_continuous_usage_and_chat_n(client):
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "def f(x): return x"}], max_tokens=6, n=2,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})]
    content = [c for c in chunks if c.choices]
    assert {c.choices[0].index for c in content} == {0, 1}
    assert all(c.choices[0].finish_reason == "length" for c in content if c.choices[0].finish_reason)
    running = [c.usage.completion_tokens for c in content if c.usage is not None]
    assert running == sorted(running) and running[-1] == 12
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


async def test_vllm_text_extensions(client, text_model):
    eos = text_model.token_to_id("<|endoftext|>")
    ids = text_model.encode("ab = 1\n") + [eos]
    kept = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=len(ids),
                                           extra_body={"skip_special_tokens": False, "ignore_eos": True})
    assert kept.choices[0].text.endswith("<|endoftext|>")
    out = await client.completions.create(model=MODEL_NAME, prompt="first = 1\nsecond = 2\n", max_tokens=30,
                                          stop=["second"], extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == "first = 1\nsecond" and out.choices[0].finish_reason == "stop"
