"""The levels of `mtpserve bench serve`: how many prompts each level of streams sends, and with `--launch
--slices N` the consecutive parts each level's prompts (or the step load's time) are visited in."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TypeVar

_Prompt = TypeVar("_Prompt")


def level_prompts(args: argparse.Namespace, concurrency: int) -> int:
    """How many prompts a level of `concurrency` streams sends: the first ones of the dataset's."""
    if args.level_prompts is not None:
        return dict(zip(args.concurrency, args.level_prompts))[concurrency]
    return max(args.num_prompts, args.prompts_per_stream * concurrency)


def check_levels(args: argparse.Namespace) -> None:
    """--level-prompts gives one count per level; --slices needs --launch and a count of at least 1, and every
    slice of a level at least as long as the level's streams (a shorter one never runs at its concurrency), or
    of the step load whole LOW and HIGH phases in pairs (each slice the load's shape, LOW first)."""
    if args.level_prompts is not None and len(args.level_prompts) != len(args.concurrency):
        raise SystemExit(f"--level-prompts needs one count per --concurrency level ({len(args.concurrency)}), "
                         f"got {len(args.level_prompts)}")
    if args.slices == 1:
        return
    if args.slices < 1 or not args.launch:
        raise SystemExit("--slices needs --launch and a count of at least 1")
    if args.step_load:
        cycles = args.duration / (2 * args.step_period * args.slices)
        if cycles < 1 or abs(cycles - round(cycles)) > 1e-6:
            raise SystemExit(f"--slices {args.slices} with --step-load: each slice must be whole LOW and HIGH phases "
                             f"in pairs (--duration a multiple of {args.slices} x 2 x --step-period)")
        return
    short = [c for c in args.concurrency if level_prompts(args, c) < args.slices * c]
    if short:
        raise SystemExit(f"--slices {args.slices}: a slice of the level(s) at {short} streams would have fewer "
                         "prompts than streams; send more prompts (--level-prompts) or use fewer slices")


def slice_prompts(prompts: Sequence[_Prompt], slices: int, part: int) -> Sequence[_Prompt]:
    """Part `part` of `slices` nearly equal consecutive parts of a level's prompts."""
    bounds = [round(i * len(prompts) / slices) for i in range(slices + 1)]
    return prompts[bounds[part]:bounds[part + 1]]


def step_part(prompts: Sequence[_Prompt], slices: int, part: int) -> list[_Prompt]:
    """The step load's prompts for its part `part` of `slices`: all of them, from the part's share on, so the
    parts do not all send the same first ones (every instance the same in one part)."""
    start = part * len(prompts) // slices
    return [*prompts[start:], *prompts[:start]]
