"""`mtpserve bench engine --model-adaptive`: the policy against fixed k in one process, from the command."""

import json
import subprocess
import sys

import pytest

from daemon_harness import BUNDLED, model_available


@pytest.mark.skipif(not model_available(), reason="no bundled model")
def test_the_command_compares_the_policy_with_every_k_round_by_round(tmp_path):
    out = tmp_path / "engine.json"
    done = subprocess.run([sys.executable, "-m", "mtpserve.cli", "bench", "engine", "--skip-synthetic",
                           "--model", str(BUNDLED), "--model-adaptive", "--model-batch", "2",
                           "--model-k", "0", "2", "--model-prompt-len", "32", "--model-max-tokens", "16",
                           "--model-rounds", "3", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "adaptive batch   2" in done.stdout
    [row] = json.loads(out.read_text())["adaptive"]
    assert set(row["decode_tokens_per_s"]) == {"k0", "k2", "adaptive"}
    assert all(len(rates) == 3 and min(rates) > 0 for rates in row["per_round"].values())
    assert row["best_fixed"] in ("k0", "k2") and row["adaptive_over_best"] > 0
    assert len(row["adaptive_rows_by_drafts"]) == 3 and sum(row["adaptive_rows_by_drafts"]) == pytest.approx(1, abs=0.01)


@pytest.mark.skipif(not model_available(), reason="no bundled model")
def test_a_closed_loop_round_serves_every_request_and_the_pinned_runner_is_reported_against_k0(tmp_path):
    out, trace = tmp_path / "engine.json", tmp_path / "adaptive.trace"
    done = subprocess.run([sys.executable, "-m", "mtpserve.cli", "bench", "engine", "--skip-synthetic",
                           "--model", str(BUNDLED), "--model-adaptive", "--model-closed-loop", "--model-pin", "0",
                           "--model-batch", "2", "--model-k", "0", "2", "--model-prompt-len", "32",
                           "--model-max-tokens", "8", "--model-rounds", "2", "--model-temperature", "1.5",
                           "--model-trace", str(trace), "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [row] = json.loads(out.read_text())["adaptive"]
    assert row["closed_loop"] is True
    assert set(row["decode_tokens_per_s"]) == {"k0", "k2", "adaptive", "k2@0"}
    assert row["best_fixed"] in ("k0", "k2")  # the pinned runner is not a fixed k
    assert set(row["over_k0_per_round"]) == {"k0", "k2", "adaptive", "k2@0"}
    assert row["over_k0_per_round"]["k0"] == 1.0
    assert "k2@0 / k0" in done.stdout
    # NOTE: every core serves the same 3 x batch requests a round, ignore_eos, each of its documented length
    # (0.75-1.25 x max tokens, spread by its index): a loop that stopped early or lost a request emits fewer
    tokens = row["tokens_per_round"]
    for r in range(2):
        counts = {name: rounds[r] for name, rounds in tokens.items()}
        assert len(set(counts.values())) == 1, counts
        assert counts["k0"] == sum(max(1, round(8 * (0.75 + 0.5 * ((i * 37) % 64) / 64))) for i in range(6))
    # NOTE: the adaptive core's steps alone: its decisions, and the tokens it emitted (its rounds' and the untimed
    # steps that end a round), not the three other cores' as well
    lines = trace.read_text().splitlines()
    assert lines[0].startswith("# time tokens rows")
    assert any(line.startswith("#d ") for line in lines)
    emitted = sum(int(line.split()[-1]) for line in lines if not line.startswith("#"))
    assert sum(tokens["adaptive"]) <= emitted < 2 * sum(tokens["adaptive"])


@pytest.mark.parametrize("option", [["--model-pin", "0"], ["--model-closed-loop"], ["--model-temperature", "1.5"],
                                    ["--model-trace", "adaptive.trace"]])
def test_an_option_of_the_adaptive_comparison_without_it_is_refused(tmp_path, option):
    done = subprocess.run([sys.executable, "-m", "mtpserve.cli", "bench", "engine", "--skip-synthetic",
                           "--model", str(BUNDLED), *option, "--out", str(tmp_path / "engine.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"{option[0]}: only with --model-adaptive" in done.stderr
    assert not (tmp_path / "engine.json").exists()



@pytest.mark.skipif(not model_available(), reason="no bundled model")
def test_a_closed_loop_round_leaves_no_step_in_flight_for_the_next():
    """A step launched for rows that finished meanwhile is finished by its own round. Left in flight (the
    adaptive core's last window may emit 1 to k+1 tokens, so its request is not surely done), the core's
    next round finished it first, with a period spanning the other cores' rounds, which the policy learnt
    as what serving adds to a step. Before the fix, 2 of these 4 rounds left one."""
    from mtpserve.bench import engine_adaptive
    from mtpserve.config import SpeculativeConfig
    from mtpserve.model.loader import load_serving_model

    model = load_serving_model(BUNDLED, draft_weight_dtype=SpeculativeConfig().draft_weight_dtype)
    core = engine_adaptive._core(model, 3, adaptive=True)
    prompts = engine_adaptive._prompts(BUNDLED, 24, 32, model.config.vocab_size)
    for r in range(4):
        seconds, tokens = engine_adaptive._closed_loop(core, f"{r}", prompts[6 * r:6 * (r + 1)], 2, 16, 0.0)
        assert seconds > 0 and tokens == sum(max(1, round(16 * (0.75 + 0.5 * ((i * 37) % 64) / 64)))
                                             for i in range(6))
        assert not core.has_unfinished_requests()
    core.close()
