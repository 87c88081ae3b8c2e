"""bench serve --launch --rounds: the comparison takes each configuration's median over its rounds."""

from mtpserve.bench.serve_launch import comparison


def test_the_comparison_uses_each_labels_median_round():
    levels = {16: {"k0": [{"output_throughput": r} for r in (1000.0, 1200.0, 1100.0)],
                   "adaptive": [{"output_throughput": r} for r in (900.0, 2000.0, 1050.0)]}}
    rows = {r["label"]: r for r in comparison(levels, ["k0", "adaptive"])}
    assert rows["k0"]["output_throughput"] == 1100.0
    assert rows["adaptive"]["output_throughput"] == 1050.0  # one lucky round does not carry it
    assert rows["adaptive"]["ratio_to_first"] == 1050.0 / 1100.0
    assert rows["k0"]["ratio_to_best_other"] == 1100.0 / 1050.0
    assert rows["adaptive"]["rounds"] == [900.0, 2000.0, 1050.0]


def test_the_comparison_plots_every_label(tmp_path):
    from mtpserve.bench.serve_report import plot_launched

    levels = {c: {label: [{"output_throughput": c * f * r} for r in (0.9, 1.1)] for label, f in (("k0", 1.0), ("k2", 1.2))}
              for c in (1, 4, 16)}
    path = plot_launched(comparison(levels, ["k0", "k2"]), tmp_path / "launched.png")
    assert path is not None and (tmp_path / "launched.png").stat().st_size > 10_000
