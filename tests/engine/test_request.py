import pytest

from mtpserve.engine.request import EngineRequest, Request
from mtpserve.ipc.sampling_params import SamplingParams, sampling_problems


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 2.0}, {"max_tokens": 0},
    {"min_tokens": 5, "max_tokens": 4}, {"logprobs": 21}, {"repetition_penalty": 0.0},
    {"presence_penalty": 3.0}, {"stop_token_ids": (-1,)}, {"seed": -1},
])
def test_invalid_sampling_params_are_rejected(kwargs):
    """One validator for both processes: the engine refuses what the HTTP side would refuse."""
    assert sampling_problems(SamplingParams(**kwargs))
    with pytest.raises(ValueError):
        EngineRequest("r", (1,), SamplingParams(**kwargs))


def test_default_sampling_params_are_valid():
    assert sampling_problems(SamplingParams()) == []


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError):
        EngineRequest("r", ())


def test_preempt_recomputes_prompt_plus_outputs():
    req = Request(EngineRequest("r", (1, 2, 3)), arrival=0, seed=7)
    req.output_ids.extend([9, 8])
    req.num_kv_tokens = 4
    req.preempt()
    assert req.prefill_ids.tolist() == [1, 2, 3, 9, 8]
    assert req.num_kv_tokens == 0 and req.epoch == 1 and req.is_prefilling


def test_a_span_of_tokens_reads_across_the_prompt_and_the_outputs_and_stops_where_they_end():
    """The prefix cache reads a block and the tokens past it this way: every span of prompt + outputs, as
    slicing their concatenation gives it."""
    req = Request(EngineRequest("r", (5, 6, 7, 8)), arrival=0, seed=7)
    req.output_ids.extend([1, 2, 3])
    whole = [5, 6, 7, 8, 1, 2, 3]
    for start in range(len(whole) + 2):
        for stop in range(start, len(whole) + 3):
            span = req.tokens(start, stop)
            assert span.dtype.name == "int64" and span.tolist() == whole[start:stop], (start, stop)
