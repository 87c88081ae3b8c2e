"""bench serve --launch --rounds: the comparison takes each configuration's median over its rounds."""

import pytest

from mtpserve.bench.serve_launch import comparison, format_comparison


def test_the_comparison_uses_each_labels_median_round():
    levels = {16: {"k0": [{"output_throughput": r} for r in (1000.0, 1200.0, 1100.0)],
                   "adaptive": [{"output_throughput": r} for r in (900.0, 2000.0, 1050.0)]}}
    rows = {r["label"]: r for r in comparison(levels, ["k0", "adaptive"])}
    assert rows["k0"]["output_throughput"] == 1100.0
    assert rows["adaptive"]["output_throughput"] == 1050.0  # one lucky round does not carry it
    assert rows["adaptive"]["ratio_to_first"] == 1050.0 / 1100.0
    assert rows["k0"]["ratio_to_best_other"] == 1100.0 / 1050.0
    assert rows["adaptive"]["rounds"] == [900.0, 2000.0, 1050.0]
    # paired: the median of the rounds' own ratios (0.9, 1.67, 0.95), so the drift of a round cancels
    assert rows["adaptive"]["paired_to_best_other"] == 1050.0 / 1100.0
    assert rows["k0"]["paired_to_best_other"] == 1100.0 / 1050.0


def test_the_comparison_plots_every_label(tmp_path):
    from mtpserve.bench.serve_report import plot_launched

    levels = {c: {label: [{"output_throughput": c * f * r} for r in (0.9, 1.1)] for label, f in (("k0", 1.0), ("k2", 1.2))}
              for c in (1, 4, 16)}
    rows = comparison(levels, ["k0", "k2"])
    assert all(r["paired_to_best_other"] is not None for r in rows)  # drawn dashed beside the medians
    path = plot_launched(rows, tmp_path / "launched.png")
    assert path is not None and (tmp_path / "launched.png").stat().st_size > 10_000


def test_the_paired_ratio_cancels_the_drift_that_two_medians_keep():
    import random

    rng, errors = random.Random(0), {"medians": [], "paired": []}
    for _ in range(200):
        drift = [rng.lognormvariate(0, 0.1) for _ in range(5)]  # the host's speed round by round, shared
        k2 = [1000.0 * d * rng.lognormvariate(0, 0.02) for d in drift]
        adaptive = [980.0 * d * rng.lognormvariate(0, 0.02) for d in drift]  # truly 0.98 of k2
        levels = {1: {"k2": [{"output_throughput": v} for v in k2],
                      "adaptive": [{"output_throughput": v} for v in adaptive]}}
        row = next(r for r in comparison(levels, ["k2", "adaptive"]) if r["label"] == "adaptive")
        errors["medians"].append(abs(row["ratio_to_best_other"] - 0.98))
        errors["paired"].append(abs(row["paired_to_best_other"] - 0.98))
    assert sum(errors["paired"]) < 0.8 * sum(errors["medians"])  # 0.68 with this seed


def test_the_paired_interval_holds_the_true_ratio_about_as_often_as_it_says():
    import random

    rng, covered, widths = random.Random(1), 0, []
    for _ in range(200):
        drift = [rng.lognormvariate(0, 0.1) for _ in range(8)]
        k0 = [500.0 * d * rng.lognormvariate(0, 0.04) for d in drift]
        adaptive = [480.0 * d * rng.lognormvariate(0, 0.04) for d in drift]  # truly 0.96 of k0
        levels = {1: {"k0": [{"output_throughput": v} for v in k0],
                      "adaptive": [{"output_throughput": v} for v in adaptive]}}
        row = next(r for r in comparison(levels, ["k0", "adaptive"]) if r["label"] == "adaptive")
        low, high = row["paired_interval"]
        assert low <= row["paired_to_best_other"] <= high
        covered += low <= 0.96 <= high
        widths.append(high - low)
    assert covered >= 0.8 * 200  # a 90% bootstrap interval of a median of 8 rounds: 0.85-0.89 (seeds 1-3)
    assert sorted(widths)[100] < 0.1  # and narrow enough to tell 0.96 from 1.0 most of the time


def test_the_paired_interval_is_against_the_other_the_ratio_is_lowest_against_and_needs_three_rounds():
    levels = {4: {"k1": [{"output_throughput": r} for r in (1000.0, 1100.0, 900.0)],
                  "k2": [{"output_throughput": r} for r in (1100.0, 1210.0, 990.0)],
                  "adaptive": [{"output_throughput": r} for r in (1045.0, 1149.5, 940.5)]}}
    rows = {r["label"]: r for r in comparison(levels, ["k1", "k2", "adaptive"])}
    # NOTE: 0.95 of k2 in every round, 1.045 of k1
    assert rows["adaptive"]["paired_interval"] == pytest.approx((0.95, 0.95))
    two = {4: {label: [{"output_throughput": r} for r in (1000.0, 1100.0)] for label in ("k0", "adaptive")}}
    assert all(r["paired_interval"] is None for r in comparison(two, ["k0", "adaptive"]))
    assert "90% interval" in format_comparison(comparison(levels, ["k1", "k2", "adaptive"]))


def _serve_args(*extra: str):
    import argparse

    from mtpserve.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--num-prompts", "6", "--input-len", "16", "--output-len", "4",
                              "--no-progress", *extra])


def test_a_level_sends_at_least_its_prompts_per_stream_and_the_same_first_prompts():
    from mtpserve.bench import serve, serve_dataset

    args = _serve_args("--concurrency", "1", "4", "--prompts-per-stream", "3")
    prompts = serve_dataset.make_dataset(args)
    assert [serve.level_prompts(args, c) for c in (1, 4)] == [6, 12]
    assert len(prompts) == 12
    assert prompts[:6] == serve_dataset.make_dataset(_serve_args("--concurrency", "1", "4"))  # a level's prefix of them


def test_level_prompts_give_each_level_its_own_count_and_must_match_the_levels():
    from mtpserve.bench import serve, serve_dataset

    args = _serve_args("--concurrency", "1", "4", "16", "--level-prompts", "5", "9", "20")
    assert [serve.level_prompts(args, c) for c in (1, 4, 16)] == [5, 9, 20]
    prompts = serve_dataset.make_dataset(args)
    assert len(prompts) == 20 and prompts[:6] == serve_dataset.make_dataset(_serve_args("--concurrency", "1"))
    with pytest.raises(SystemExit, match="one count per --concurrency level"):
        serve.run(_serve_args("--concurrency", "1", "4", "--level-prompts", "5"))


async def test_the_step_load_visits_every_instance_each_round_in_turn_and_compares_medians(monkeypatch):
    await _two_rounds_of_the_step_load(monkeypatch, relaunch=False)


async def test_relaunch_starts_the_instances_afresh_for_every_round(monkeypatch):
    await _two_rounds_of_the_step_load(monkeypatch, relaunch=True)


async def _two_rounds_of_the_step_load(monkeypatch, relaunch: bool) -> None:
    launches: list[list[str]] = []
    report = await _launched(monkeypatch, launches, "--step-load", "1", "2", "--step-period", "0.1", "--duration",
                             "0.3", "--rounds", "2", *(["--relaunch"] if relaunch else []))
    assert len(launches) == (2 if relaunch else 1)
    assert [(r["label"], r["round"]) for r in report["runs"]] == [("a", 1), ("b", 1), ("b", 2), ("a", 2)]
    assert all(r["summary"]["completed"] > 0 and r["summary"]["failed"] == 0 for r in report["runs"])
    rows = {r["label"]: r for r in report["comparison"]}
    assert len(rows["a"]["rounds"]) == 2 and rows["a"]["concurrency"] == 2


async def test_a_sliced_step_load_visits_every_instance_with_each_part_of_the_time_and_pairs_them(monkeypatch):
    """Two rounds of two slices: each slice runs half the duration's phases on each instance in turn, and each
    slice visit is a round of its own in the comparison."""
    report = await _launched(monkeypatch, [], "--step-load", "1", "2", "--step-period", "0.2", "--duration", "0.8",
                             "--rounds", "2", "--slices", "2")
    visits = [(r["label"], r["round"], r["slice"]) for r in report["runs"]]
    assert visits == [("a", 1, 1), ("b", 1, 1), ("b", 1, 2), ("a", 1, 2),
                      ("a", 2, 1), ("b", 2, 1), ("b", 2, 2), ("a", 2, 2)]
    # NOTE: a part's time, not the whole duration's (an in-flight request may end it a little later)
    assert all(0.4 <= r["summary"]["elapsed_s"] < 0.8 and r["summary"]["completed"] > 0 for r in report["runs"])
    rows = {r["label"]: r for r in report["comparison"]}
    assert len(rows["a"]["rounds"]) == 4 and rows["a"]["paired_interval"] is not None


async def test_each_level_takes_its_instances_in_turn_round_by_round(monkeypatch):
    """Two instances at two levels: each level's rounds start with a and b in turn (turned by the visits
    so far, a went first at every round of the first level and b at the second)."""
    report = await _launched(monkeypatch, [], "--concurrency", "1", "2", "--rounds", "2")
    firsts = {(r["concurrency"], r["round"]): r["label"] for r in reversed(report["runs"])}  # each visit's first
    assert [firsts[1, 1], firsts[1, 2]] == ["a", "b"]
    assert [firsts[2, 1], firsts[2, 2]] == ["b", "a"]


async def test_slices_visit_every_instance_with_each_part_of_a_level_and_pair_as_rounds(monkeypatch):
    report = await _launched(monkeypatch, [], "--concurrency", "1", "--level-prompts", "6", "--rounds", "2",
                             "--slices", "3")
    visits = [(r["label"], r["round"], r["slice"], r["summary"]["completed"]) for r in report["runs"]]
    assert visits[:4] == [("a", 1, 1, 2), ("b", 1, 1, 2), ("b", 1, 2, 2), ("a", 1, 2, 2)]  # two prompts each
    assert len(visits) == 12
    rows = {r["label"]: r for r in report["comparison"]}
    assert len(rows["a"]["rounds"]) == 6 and rows["a"]["paired_interval"] is not None


async def _launched(monkeypatch, launches: list[list[str]], *flags: str) -> dict:
    """`bench serve --launch a= b= FLAGS` against two fake servers in this process (`launches`: each start's
    specs); the report."""
    import subprocess

    from aiohttp.test_utils import TestServer
    from bench_fake_server import MODEL, fake_app

    from mtpserve.bench import serve
    from mtpserve.bench.serve_launch import Instance

    args = _serve_args("--model", MODEL, "--launch", "a=", "b=", "--out", "/dev/null", *flags)
    done = subprocess.Popen(["true"])  # the servers are in this process; an instance's process is only kept
    done.wait()
    async with TestServer(fake_app()) as a, TestServer(fake_app()) as b:
        def start_all(specs: list[str]) -> list[Instance]:  # NOTE: the boundary: no `mtpserve serve` processes
            launches.append(specs)
            return [Instance(label, str(server.make_url("")).rstrip("/"), done, label)
                    for label, server in (("a", a), ("b", b))]

        monkeypatch.setattr(serve, "start_all", start_all)
        monkeypatch.setattr(serve, "plot_launched", lambda rows, path: None)
        return await serve.run_launched(args)


def test_slices_split_a_level_into_consecutive_parts_and_each_must_hold_its_streams():
    from mtpserve.bench.serve_levels import check_levels, slice_prompts, step_part

    level = list("abcdefg")
    assert [slice_prompts(level, 3, i) for i in range(3)] == [list("ab"), list("cde"), list("fg")]
    assert [step_part(level, 3, i)[:2] for i in range(3)] == [list("ab"), list("cd"), list("ef")]
    assert sorted(step_part(level, 3, 2)) == level  # every prompt, from the part's share on
    check_levels(_serve_args("--concurrency", "1", "4", "--level-prompts", "8", "16", "--slices", "4",
                             "--launch", "a="))
    with pytest.raises(SystemExit, match="at \\[4\\] streams"):
        check_levels(_serve_args("--concurrency", "1", "4", "--level-prompts", "8", "15", "--slices", "4",
                                 "--launch", "a="))
    with pytest.raises(SystemExit, match="needs --launch"):
        check_levels(_serve_args("--slices", "2"))
    step = ("--launch", "a=", "--step-load", "1", "64", "--step-period", "10")
    check_levels(_serve_args(*step, "--duration", "120", "--slices", "3"))  # two LOW and HIGH pairs a slice
    for duration, slices in (("120", "4"), ("100", "3"), ("120", "7")):  # 15 s, 16.7 s, 8.6 s a slice
        with pytest.raises(SystemExit, match="whole LOW and HIGH phases"):
            check_levels(_serve_args(*step, "--duration", duration, "--slices", slices))

def test_the_step_loads_phases_count_each_chunk_where_it_arrived():
    from mtpserve.bench.serve_client import RequestResult
    from mtpserve.bench.serve_step_load import phase_throughput

    def result(start: float, gaps: list[float], tokens: int) -> RequestResult:
        return RequestResult(True, "", start, 0.5, 0.5 + sum(gaps), gaps, 10, tokens, len(gaps) + 1, None)

    # 100 s from t=1000 in phases of 10 s: LOW from 1000, HIGH from 1010, ...
    quiet = result(1000.0, [1.0] * 3, 40)  # four chunks at 1000.5-1003.5: LOW
    crossing = result(1008.0, [1.0] * 3, 40)  # 1008.5, 1009.5 in LOW; 1010.5, 1011.5 in HIGH
    phases = phase_throughput([quiet, crossing], 100.0, 1000.0, 10.0)
    assert phases["low"] == (40 + 20) / 50.0
    assert phases["high"] == 20 / 50.0


def test_a_visit_with_failed_requests_is_left_out_of_the_medians_and_the_pairs(tmp_path):
    """A k=1 rank that died in round 1 served its visits then with failures, or not at all (0 tok/s): that
    round measures the crash, not k=1."""
    from mtpserve.bench.serve_report import plot_launched

    def visits(rates, failed=()):
        return [{"output_throughput": r, "failed": 52 if i in failed else 0} for i, r in enumerate(rates, 1)]

    levels = {64: {"k1": visits([0.0, 2600.0, 2700.0], failed={1}),
                   "adaptive": visits([2800.0, 2650.0, 2750.0])},
              1: {"k1": visits([0.0, 0.0], failed={1, 2}), "adaptive": visits([800.0, 820.0])}}
    rows = {(r["concurrency"], r["label"]): r for r in comparison(levels, ["k1", "adaptive"])}
    k1, adaptive = rows[64, "k1"], rows[64, "adaptive"]
    assert k1["output_throughput"] == 2650.0 and k1["failed_rounds"] == [1]
    assert adaptive["ratio_to_best_other"] == 2750.0 / 2650.0
    assert adaptive["paired_to_best_other"] == (2650.0 / 2600.0 + 2750.0 / 2700.0) / 2  # rounds 2 and 3 only
    assert rows[1, "k1"]["output_throughput"] is None and rows[1, "adaptive"]["ratio_to_best_other"] is None
    assert rows[1, "adaptive"]["ratio_to_first"] is None and rows[1, "adaptive"]["paired_to_best_other"] is None
    table = format_comparison(list(rows.values()))
    assert "left out: round 1" in table and "left out: round 1, 2" in table
    assert plot_launched(list(rows.values()), tmp_path / "launched.png") is not None


def test_a_launch_entrys_leading_assignments_set_its_instances_environment(tmp_path):
    """'LABEL=NAME=VALUE ... flags': the words before the first flag set that instance's environment (another
    tree's package, a debug trace), the rest are its flags; a NAME=VALUE after a flag stays a flag."""
    import sys

    from mtpserve.bench.serve_launch import instance_environment, popen_logged

    env, args = instance_environment(["MTP_T=/tmp/t", "PYTHONPATH=", "--num-speculative-tokens", "3", "A=B"])
    assert args == ["--num-speculative-tokens", "3", "A=B"]
    assert env is not None and env["MTP_T"] == "/tmp/t" and env["PYTHONPATH"] == "" and "PATH" in env
    assert instance_environment(["--port", "1"]) == (None, ["--port", "1"])
    log = tmp_path / "child.log"
    child = popen_logged([sys.executable, "-c", "import os; print(os.environ['MTP_T'], repr(os.environ['PYTHONPATH']))"],
                         log, env)
    assert child.wait() == 0 and log.read_text().split() == ["/tmp/t", "''"]
