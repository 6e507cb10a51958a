"""Constraint-stage cost per decode step as constrained rows grow: 1 to 256 rows, 2K and 150K
vocabularies, our stage (own grammar, split) against vLLM's native path, with unconstrained rows
mixed in.

    python benchmarks/scale_rows.py [--rows 1,4,16,64,256] [--steps 24] [--rounds 3] [--json OUT] [--plot PNG]

Every row is a request of its own: one of 8 allowed subsets (4 of a 32-tool catalog, agent-like
schemas), replaying an ``auto`` answer (a sentence, then a call) from its own offset, so the batch
holds rows in free text, in a call's name and in its arguments at once; a row that finishes its
answer starts again as a new request (outside the timed part). What one step costs, timed:

* ours: :class:`MaskedBatch` ``sync()`` + ``apply()`` on CPU logits, as our logits processor runs
  each step, every row on its subset's own grammar (a split row moves to it once it is compiled,
  in the background);
* split: the same, every row kept on the catalog's grammar AND its subset's envelope (a subset's
  first steps, before its own grammar is compiled);
* native: vLLM 0.32's structured-output path, its parts called as vLLM calls them: each row's
  ``XgrammarGrammar.accept_tokens`` (the scheduler, per request), the bitmask fill as
  ``StructuredOutputManager.grammar_bitmask`` runs it (serial up to 128 rows, above that batches of
  16 in a thread pool of min(cores / 2, 8) threads), then ``apply_grammar_bitmask``'s CPU part
  (the bitmask reordered to the batch, xgrammar's kernel);
* ours, mixed: with as many unconstrained rows interleaved (a batch of 2N, every other row
  constrained);
* grammar only (native, ours, split): the same without applying the mask to the logits: what stays on
  the CPU when the logits are on a GPU (there the mask is one xgrammar kernel on the device);
* logits write: one write of -inf over the rows' logits, the floor of any mask applied on CPU.

The paths are interleaved in every round, so machine noise hits them alike; the table reports each
path's median step in its least disturbed round (the JSON also has the median over all rounds and
the p90), and its cost at N rows over its cost at one row.
Nothing is asserted: docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale_report  # noqa: E402
from constraint_stage import _answer  # noqa: E402  (benchmarks/ is a folder of scripts)
from grammar_inputs import (  # noqa: E402
    greedy_encode,
    rich_functions,
    synthetic_tokenizer_info,
    tiny_tokenizer_info,
)

from vllm_allowed_tools.decode.masks import CompiledGrammars, MaskedBatch  # noqa: E402
from vllm_allowed_tools.decode.split import constraint_extra_args, split_tags  # noqa: E402
from vllm_allowed_tools.decode.grammar import turn_tag  # noqa: E402
from vllm_allowed_tools.decode.stage import read_extra_args  # noqa: E402

PATHS = ("native", "native, grammar only", "ours", "ours, grammar only", "ours, mixed",
         "split", "split, grammar only", "logits write")
SUBSETS = 8


class _Requests:
    """The 8 subsets' grammars and answers for one vocabulary."""

    def __init__(self, info: Any, encode, catalog_size: int = 32, allowed: int = 4) -> None:
        rng = random.Random(5)
        catalog = rich_functions(catalog_size, seed=catalog_size)
        self.info = info
        self.grammars = CompiledGrammars(info, lazy=False)
        self.split_grammars = CompiledGrammars(info, upgrade=False)   # a split row that stays split
        self.whole, self.split, self.answers = [], [], []
        for index in range(SUBSETS):
            subset = rng.sample(catalog, allowed)
            common = dict(catalog_digest=f"scale-{catalog_size}", allowlist_digest=f"subset-{index}",
                          mode="auto", parallel_tool_calls=True)
            tag = turn_tag("hermes", subset, **common)
            self.whole.append(read_extra_args(constraint_extra_args(tag)))
            self.split.append(read_extra_args(constraint_extra_args(
                tag, split_tags("hermes", catalog, subset, **common))))
            self.answers.append(encode(_answer(subset, rng)))
        for grammars in (self.grammars, self.split_grammars):   # compiled before anything is timed
            grammars.catalog(self.split[0].catalog)
            for whole, split in zip(self.whole, self.split):
                grammars.get(whole)
                grammars.get(split.envelope)
        self.stops = list(info.stop_token_ids)


class _Rows:
    """Which answer each row replays and where it is; the tokens a step appends."""

    def __init__(self, requests: _Requests, rows: int) -> None:
        self.requests = requests
        self.subset = [row % SUBSETS for row in range(rows)]
        self.position = [(row * 7) % len(requests.answers[row % SUBSETS]) for row in range(rows)]

    def answer(self, row: int) -> list[int]:
        return self.requests.answers[self.subset[row]]


class _OurStage:
    """Our logits processor's core: MaskedBatch over ``rows`` requests (``spread``: every other row
    of a batch twice the size, the rest unconstrained)."""

    def __init__(self, requests: _Requests, rows: int, split: bool, spread: int = 1,
                 grammar_only: bool = False) -> None:
        import torch
        self.requests, self.split, self.spread, self.grammar_only = requests, split, spread, grammar_only
        self.rows = _Rows(requests, rows)
        grammars = requests.split_grammars if split else requests.grammars
        self.batch = MaskedBatch(grammars, requests.info.vocab_size, max_rows=rows * spread)
        self.logits = torch.zeros(rows * spread, requests.info.vocab_size)
        self.outputs: list[list[int]] = []
        for row in range(rows):
            self.outputs.append([])
            self._start(row)
        for slot in range(rows * spread):   # the unconstrained rows
            if slot % spread:
                self.batch.add(slot, None, [], [])

    def _grammar(self, row: int):
        source = self.requests.split
        return source[self.rows.subset[row]]

    def _start(self, row: int) -> None:
        """A new request in ``row``, its output already holding the tokens before its offset."""
        output = self.outputs[row] = list(self.rows.answer(row)[:self.rows.position[row]])
        self.batch.add(row * self.spread, self._grammar(row), output, self.requests.stops)
        self.batch.sync()

    def advance(self) -> None:
        """Untimed: each row's next token (a finished answer restarts as a new request)."""
        for row, output in enumerate(self.outputs):
            answer = self.rows.answer(row)
            if self.rows.position[row] >= len(answer):
                self.rows.position[row] = 0
                self._start(row)
                output = self.outputs[row]
            output.append(answer[self.rows.position[row]])
            self.rows.position[row] += 1

    def step(self) -> None:
        self.batch.sync()
        if self.grammar_only:      # what stays on the CPU when the logits are on a GPU
            self.batch.prepare(self.logits.shape[0])
        else:
            self.batch.apply(self.logits)


class _Native:
    """vLLM's structured-output path for ``rows`` requests, its own classes and thresholds."""

    def __init__(self, requests: _Requests, rows: int, grammar_only: bool = False) -> None:
        import torch
        import xgrammar as xgr
        self.grammar_only = grammar_only
        from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar
        self.xgr, self.torch, self.grammar_class = xgr, torch, XgrammarGrammar
        self.requests = requests
        self.rows = _Rows(requests, rows)
        vocab = requests.info.vocab_size
        self.bitmask = xgr.allocate_token_bitmask(rows, vocab)
        self.logits = torch.zeros(rows, vocab)
        self.grammars: list[Any] = [None] * rows
        self.pending: list[list[int]] = [[] for _ in range(rows)]
        # StructuredOutputManager's thresholds (vllm/v1/structured_output/__init__.py)
        self.parallel_threshold, self.parallel_batch = 128, 16
        self.executor = ThreadPoolExecutor(max(1, min(os.cpu_count() // 2, 8))) if rows > 128 else None
        for row in range(rows):
            self._start(row)

    def _start(self, row: int) -> None:
        compiled = self.requests.grammars.get(self.requests.whole[self.rows.subset[row]])
        matcher = self.xgr.GrammarMatcher(compiled, override_stop_tokens=self.requests.stops)
        grammar = self.grammar_class(vocab_size=self.requests.info.vocab_size, matcher=matcher,
                                     ctx=compiled)
        grammar.accept_tokens(f"r{row}", self.rows.answer(row)[:self.rows.position[row]])
        self.grammars[row] = grammar

    def advance(self) -> None:
        for row in range(len(self.grammars)):
            answer = self.rows.answer(row)
            if self.rows.position[row] >= len(answer):
                self.rows.position[row] = 0
                self._start(row)
            self.pending[row] = [answer[self.rows.position[row]]]
            self.rows.position[row] += 1

    def _fill(self, batch) -> None:
        for grammar, index in batch:
            if not grammar.is_terminated():
                grammar.fill_bitmask(self.bitmask, index)
            else:
                self.bitmask[index].fill_(-1)

    def step(self) -> None:
        for row, grammar in enumerate(self.grammars):        # the scheduler's update_from_output
            grammar.accept_tokens(f"r{row}", self.pending[row])
        work = [(grammar, row) for row, grammar in enumerate(self.grammars)]
        if self.executor is not None and len(work) > self.parallel_threshold:
            chunks = [work[i:i + self.parallel_batch] for i in range(0, len(work), self.parallel_batch)]
            for future in [self.executor.submit(self._fill, chunk) for chunk in chunks]:
                future.result()
        else:
            self._fill(work)
        if self.grammar_only:      # on a GPU the bitmask is copied over and applied by a kernel
            return
        bitmask = self.bitmask.numpy()                       # apply_grammar_bitmask, CPU
        ordered = self.torch.full(tuple(self.bitmask.shape), -1, dtype=self.torch.int32)
        ordered_view = ordered.numpy()
        for row in range(len(work)):
            ordered_view[row] = bitmask[row]
        self.xgr.apply_token_bitmask_inplace(self.logits, ordered, indices=None)


class _LogitsWrite:
    """The floor of any CPU mask: one write of -inf over the rows' logits (numpy's memset)."""

    def __init__(self, requests: _Requests, rows: int) -> None:
        import numpy as np
        self.logits = np.zeros((rows, requests.info.vocab_size), dtype=np.float32)

    def advance(self) -> None:
        pass

    def step(self) -> None:
        self.logits.fill(float("-inf"))


def _make(path: str, requests: _Requests, rows: int):
    if path.startswith("native"):
        return _Native(requests, rows, grammar_only=path.endswith("grammar only"))
    if path == "logits write":
        return _LogitsWrite(requests, rows)
    return _OurStage(requests, rows, split=path.startswith("split"),
                     spread=2 if path.endswith("mixed") else 1, grammar_only=path.endswith("grammar only"))


def bench_rows(row_counts: list[int], steps: int, rounds: int, vocabularies: list[str]) -> list[dict[str, Any]]:
    results = []
    for vocab_name in vocabularies:
        if vocab_name == "2K":
            info, tokenizer = tiny_tokenizer_info()
            encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        else:
            info, index = synthetic_tokenizer_info()
            encode = lambda text: greedy_encode(text, index)  # noqa: E731
        requests = _Requests(info, encode)
        for rows in row_counts:
            drivers = {path: _make(path, requests, rows) for path in PATHS}
            # fewer steps for the large batches: a 256-row step of the native path at 150K is ~0.1 s
            count = max(4, min(steps, steps * 16 // max(rows, 1)))
            rounds_of: dict[str, list[list[float]]] = {path: [] for path in PATHS}
            for _ in range(rounds + 1):
                for path, driver in drivers.items():
                    times = []
                    for _ in range(count):
                        driver.advance()
                        start = time.perf_counter()
                        driver.step()
                        times.append(time.perf_counter() - start)
                    rounds_of[path].append(times)
            for path in PATHS:
                kept = rounds_of[path][1:]          # the first round warms up
                everything = sorted(t for times in kept for t in times)
                # the least disturbed round's median: the machine is shared, and another job's
                # burst lands on some rounds, not on the stage
                results.append({"vocab": vocab_name, "rows": rows, "path": path,
                                "us_per_step": min(statistics.median(times) for times in kept) * 1e6,
                                "median_all_us": statistics.median(everything) * 1e6,
                                "p90_us": everything[int(len(everything) * 0.9)] * 1e6})
            print(f"  {vocab_name} {rows} rows: " + ", ".join(
                f"{r['path']} {r['us_per_step']:.0f} us" for r in results[-len(PATHS):]), flush=True)
            del drivers
    for result in results:
        one = next(r for r in results if r["vocab"] == result["vocab"] and r["path"] == result["path"]
                   and r["rows"] == min(row_counts))
        result["x_one_row"] = result["us_per_step"] / one["us_per_step"]
        result["us_per_row"] = result["us_per_step"] / result["rows"]
    return results


def table(results: list[dict[str, Any]]) -> str:
    """Rows x paths, µs per step (and times the one-row step), one line per vocabulary and row count."""
    lines = ["| vocabulary | rows | " + " | ".join(PATHS) + " |", "|---|---:|" + "---:|" * len(PATHS)]
    keys = sorted({(r["vocab"], r["rows"]) for r in results}, key=lambda k: (k[0] != "2K", k[1]))
    for vocab, rows in keys:
        cells = []
        for path in PATHS:
            r = next(x for x in results if (x["vocab"], x["rows"], x["path"]) == (vocab, rows, path))
            cells.append(f"{_us(r['us_per_step'])} ({r['x_one_row']:.1f}x)")
        lines.append(f"| {vocab} | {rows} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _us(value: float) -> str:
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.0f} µs"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    vocabularies = sorted({r["vocab"] for r in results}, key=lambda v: v != "2K")
    figure, axes = scale_report.figure(len(vocabularies), (5.5 * len(vocabularies), 4))
    for axis, vocab in zip(axes if len(vocabularies) > 1 else [axes], vocabularies):
        for name in PATHS:
            points = sorted((r["rows"], r["us_per_step"]) for r in results
                            if r["vocab"] == vocab and r["path"] == name)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        scale_report.log_log(axis, "constrained rows", "µs per decode step", f"{vocab} vocabulary",
                             legend_size=None)
    scale_report.save(figure, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--vocab", default="2K,150K")
    parser.add_argument("--steps", type=int, default=24, help="timed steps per path and round (fewer above 16 rows)")
    parser.add_argument("--rounds", type=int, default=4)
    scale_report.add_output_arguments(parser)
    args = parser.parse_args()
    results = bench_rows([int(n) for n in args.rows.split(",")], args.steps, args.rounds,
                         args.vocab.split(","))
    return scale_report.report("constraint-stage cost per decode step vs constrained rows (CPU)",
                               results, table, plot, args)


if __name__ == "__main__":
    raise SystemExit(main())
