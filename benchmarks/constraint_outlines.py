"""outlines_core next to xgrammar on a required turn of a JSON-array format (``constraint_stage.py
--part outlines``).

The grammar is the registry's ``json_array`` schema (decode/grammar.py, here ``mistral``'s) for 1,
4, 16 and 64 allowed ``rich_functions``: xgrammar compiles it (``compile_json_schema``, no cache)
and masks with a ``GrammarMatcher``; outlines_core builds a regex from it
(``build_regex_from_schema``) and an ``Index`` over the vocabulary (what vLLM's outlines backend
does; for the tiny model with vLLM's own vocabulary conversion), and masks with a ``Guide``
(``advance`` + ``write_mask_into``, what vLLM runs per token). Per token: advancing by the answer's
token and filling the next bitmask, over one whole call; applying the bitmask is the same kernel for
both and left out. Each outlines measurement runs in a child process stopped after
``timeout`` seconds ("> N s").
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from typing import Any

from grammar_inputs import (
    greedy_encode,
    median_p90,
    rich_functions,
    synthetic_tokenizer_info,
    tiny_tokenizer_info,
)

from vllm_allowed_tools.decode.grammar import call_array_schema

TOOL_COUNTS = (1, 4, 16, 64)


def required_schema(count: int) -> dict[str, Any]:
    """The allowed subset's required-mode JSON schema of a JSON-array format (what outlines gets)."""
    return call_array_schema("mistral", rich_functions(count), parallel_tool_calls=True)


def answer_text(count: int) -> str:
    """One call of the first tool, every property in schema order, compact as a model writes it."""
    function = rich_functions(count)[0]
    values = {"string": "src/main.py", "integer": 7, "array": ["a", "b"], "object": {"recursive": True}}
    arguments = {name: schema["enum"][0] if "enum" in schema else values[schema["type"]]
                 for name, schema in function.parameters["properties"].items()}
    return json.dumps([{"name": function.name, "arguments": arguments}])


def bench_outlines(rounds: int, timeout: float) -> list[dict[str, Any]]:
    rows = []
    for vocab_name, info, vocabulary, encode in _vocabularies():
        for count in TOOL_COUNTS:
            schema, tokens = required_schema(count), encode(answer_text(count))
            xgrammar = _xgrammar(info, schema, tokens, rounds)
            outlines = _in_child(_outlines, (vocabulary, info.vocab_size, schema, tokens, rounds), timeout)
            rows.append({"vocab": vocab_name, "tools": count, "answer tokens": len(tokens),
                         "xgrammar compile ms": f"{xgrammar['build_s'] * 1e3:.1f}",
                         "outlines regex + index ms": _ms(outlines, "build_s", timeout),
                         "xgrammar per token us (median / p90)": xgrammar["per_token"],
                         "outlines per token us (median / p90)": _us(outlines),
                         "outlines regex kB": f"{len(_regex(schema)) / 1024:.1f}"})
    return rows


def _vocabularies():
    import outlines_core as oc
    from vllm.v1.structured_output.utils import get_outlines_vocabulary
    tiny, tokenizer = tiny_tokenizer_info()
    large, index = synthetic_tokenizer_info()
    eos = large.stop_token_ids[0]
    synthetic = oc.Vocabulary(eos, {token.encode(): [i] for token, i in index.items() if i != eos})
    return (("2K (tiny)", tiny, get_outlines_vocabulary(tokenizer).inner,
             lambda text: tokenizer.encode(text, add_special_tokens=False)),
            ("150K (synthetic)", large, synthetic, lambda text: greedy_encode(text, index)))


def _regex(schema: dict[str, Any]) -> str:
    from outlines_core.json_schema import build_regex_from_schema
    return build_regex_from_schema(json.dumps(schema))


def _xgrammar(info, schema: dict[str, Any], tokens: list[int], rounds: int) -> dict[str, float]:
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
    builds = []
    for _ in range(max(1, rounds)):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(schema)
        builds.append(time.perf_counter() - start)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    steps = []
    for _ in range(max(1, rounds)):
        matcher = xgr.GrammarMatcher(compiled)
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            assert matcher.accept_token(token), "the benchmark answer must be admissible"
            steps.append(time.perf_counter() - start)
    return {"build_s": statistics.median(builds), "per_token": median_p90(steps, scale=1e6)}


def _outlines(vocabulary, vocab_size: int, schema: dict[str, Any], tokens: list[int],
              rounds: int) -> dict[str, float]:
    """In the child: the regex and index built once (the expensive part), then masking."""
    import outlines_core as oc
    import torch
    start = time.perf_counter()
    index = oc.Index(_regex(schema), vocabulary)
    build_s = time.perf_counter() - start
    mask = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)   # as vLLM allocates
    steps = []
    assert oc.Guide(index).accepts_tokens(tokens), "the benchmark answer must be admissible"
    for _ in range(max(1, rounds)):
        guide = oc.Guide(index)
        for token in tokens:
            start = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            guide.advance(token, return_tokens=False)
            steps.append(time.perf_counter() - start)
    return {"build_s": build_s, "per_token": median_p90(steps, scale=1e6)}


def _child(conn, function, args) -> None:
    try:
        conn.send(function(*args))
    except BaseException as error:   # noqa: BLE001 - reported as the cell's value
        conn.send({"error": f"{type(error).__name__}: {error}"[:120]})


def _in_child(function, args, timeout: float) -> dict[str, Any]:
    """``function(*args)`` in a forked child, or ``{"timeout": True}`` after ``timeout`` seconds."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(send, function, args), daemon=True)
    process.start()
    result = receive.recv() if receive.poll(timeout) else {"timeout": True}
    process.kill()
    process.join()
    return result


def _ms(result: dict[str, Any], key: str, timeout: float) -> str:
    if result.get("timeout"):
        return f"> {timeout:.0f} s"
    return result.get("error") or f"{result[key] * 1e3:.1f}"


def _us(result: dict[str, Any]) -> str:
    if result.get("timeout"):
        return "(index not built)"
    return result.get("error") or result["per_token"]
