"""`mtpserve bench attention --layouts`: consecutive against scattered blocks, by block size."""

from __future__ import annotations

import json

import pytest

from mtpserve.bench import attention
from mtpserve.model.attention_context import PAGED_OP
from mtpserve.ops import cpu_op_available

pytestmark = pytest.mark.skipif(not cpu_op_available(PAGED_OP), reason="the CPU attention op is not built")


def test_each_block_size_is_timed_in_both_layouts_side_by_side():
    rows = attention.run_layouts([16, 64], [100], repeats=2, rows=4, pool_tokens=4096)
    assert [(r["block_size"], r["context"]) for r in rows] == [(16, 100), (64, 100)]
    for row in rows:
        us = row["us_per_call"]
        assert set(us) == set(attention.LAYOUTS) and all(t > 0 for t in us.values())
        assert row["scattered_over_consecutive"] == pytest.approx(us["scattered"] / us["consecutive"], rel=0.01)
    json.dumps(rows)


def test_rows_that_do_not_fit_the_pool_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        attention.time_layout(attention.LayoutCase(64, "scattered", 8, 1024), 1, pool_tokens=4096)
