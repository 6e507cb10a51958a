"""The constraint stage measured: grammar compile time, per-token mask cost, decode throughput.

    python benchmarks/constraint_stage.py [--part compile|catalog-names|subset|mask|decode|outlines|all] [--rounds 3]

* compile: building and compiling the allowed-subset structural tag (hermes) for catalogs of 8, 32
  and 128 tools (every tool allowed: the largest grammar a turn of that catalog needs), cold and
  through our caches (built-tag cache + compiled-grammar cache), with the tiny model's tokenizer
  (2K vocabulary) and a synthetic 150K-token vocabulary;
* catalog-names: the same for a plain ``auto`` request's grammar (every tool of its catalog, only
  the names constrained: arguments any JSON object, as for tools that are not ``strict``);
* subset: what a first-seen allowed subset (2, 4, 8 of 32 and 128 tools) of a known catalog adds to
  its request at both vocabulary sizes: its own grammar compiled without and with xgrammar's cache,
  against the split (the catalog's grammar compiled once, the subset's envelope per subset);
* mask: per generated token, advancing the matcher(s) and filling + applying the bitmask for one
  row, over a whole tool-call answer, at both vocabulary sizes, whole grammar and split;
  xgrammar's published figure for JSON grammars (tens of microseconds per token at a 128K
  vocabulary) is the anchor;
* decode: generated tokens per second with the offline ``LLM`` on the tiny tool-happy model:
  unconstrained vs vLLM's native structural tag vs our logits-processor stage (whole grammar, and
  split), auto and required,
  batch 1 and 16, interleaved over rounds so machine noise hits every variant alike (every request
  makes exactly ``--tokens`` tokens: ``ignore_eos``);
* outlines: outlines_core next to xgrammar on a JSON-array format's required-mode schema (1 to 64
  allowed tools): build time and per-token mask cost at both vocabulary sizes, each outlines
  measurement capped at ``--outlines-timeout`` seconds (constraint_outlines.py).

Nothing here is asserted: docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm_allowed_tools.decode.grammar import (
    AllowedFunction,
    GrammarKey,
    cached_subset_tag,
    build_structural_tag,
    built,
    clear_tag_cache,
    turn_tag,
)
from vllm_allowed_tools.decode.masks import CompiledGrammars, MaskedBatch
from vllm_allowed_tools.decode.split import split_tags
from vllm_allowed_tools.decode.split import constraint_extra_args
from vllm_allowed_tools.decode.stage import read_extra_args

from grammar_inputs import (
    greedy_encode,
    median_p90,
    rich_functions,
    synthetic_tokenizer_info,
    tiny_tokenizer_info,
)


def _timed(function, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------ compile
def bench_compile(rounds: int, strict: bool = True) -> list[dict[str, Any]]:
    tiny, _ = tiny_tokenizer_info()
    large, _ = synthetic_tokenizer_info()
    rows = []
    for vocab_name, info in (("2K (tiny)", tiny), ("150K (synthetic)", large)):
        for count in (8, 32, 128):
            functions = rich_functions(count, strict=strict)
            key = GrammarKey("hermes", f"catalog-{count}-{strict}", f"all-{count}", "auto", True)

            def cold():
                tag = built(build_structural_tag("hermes", functions, "auto"))
                CompiledGrammars(info, capacity=4).get(read_extra_args(constraint_extra_args(tag)))

            clear_tag_cache()
            grammars = CompiledGrammars(info, lazy=False)
            warm_tag = cached_subset_tag(key, lambda: functions)
            grammars.get(read_extra_args(constraint_extra_args(warm_tag)))

            def cached():   # what a repeated turn costs: frontend tag cache + engine grammar cache
                tag = cached_subset_tag(key, lambda: functions)
                grammars.get(read_extra_args(constraint_extra_args(tag), verify=False))

            def admission():   # the once-per-request digest check (validate_params)
                read_extra_args(constraint_extra_args(warm_tag))

            cold_s = _timed(cold, max(1, rounds))
            cached_s = _timed(cached, 200)
            rows.append({"vocab": vocab_name, "tools": count, "cold_ms": cold_s * 1e3,
                         "cached_us": cached_s * 1e6, "cold/cached": cold_s / cached_s,
                         "admission_digest_us": _timed(admission, 200) * 1e6,
                         "tag_kb": len(warm_tag.json) / 1024})
    return rows


# ------------------------------------------------------------------------------------------ subset
def bench_subset(rounds: int) -> list[dict[str, Any]]:
    """What a first-seen allowed subset of a known catalog adds to its request, on each path.

    * whole, no cache: the subset's own grammar built and compiled by a compiler without xgrammar's
      cache (the logits-processor stage before the split, and the issue's figures);
    * whole, xgrammar cache: the same through a compiler with xgrammar's cache on that has compiled
      earlier subsets of the catalog (what vLLM's native stage has: its compiler's cache is on);
    * split: the subset's envelope built and compiled, the catalog's grammar already compiled (the
      first request of a catalog pays ``catalog_compile_ms`` once, in the engine's background).

    Every sample is a subset never seen before (new allowlist digest), timed from the turn's
    functions to the row's matchers, the admission digest check included."""
    import xgrammar as xgr
    rng = random.Random(21)
    rows = []
    for vocab_name, info in (("2K (tiny)", tiny_tokenizer_info()[0]),
                             ("150K (synthetic)", synthetic_tokenizer_info()[0])):
        for count in (32, 128):
            catalog = rich_functions(count, seed=count)
            cold = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
            native = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=True)
            grammars = CompiledGrammars(info, upgrade=False)   # first-seen subsets stay split
            started = time.perf_counter()
            grammars.catalog(_first_seen(catalog, catalog[:1], "warm-up").catalog)
            catalog_s = time.perf_counter() - started
            for allowed_count in (2, 4, 8):
                samples: dict[str, list[float]] = {"whole, no cache": [], "whole, xgrammar cache": [],
                                                   "split": []}
                for sample in range(max(3, rounds)):
                    allowed = sorted(rng.sample(catalog, allowed_count), key=catalog.index)
                    for path, values in samples.items():
                        start = time.perf_counter()
                        grammar = _first_seen(catalog, allowed, f"{count}-{allowed_count}-{sample}-{path}",
                                              split=path == "split")
                        if path == "split":
                            assert grammars.matchers(grammar)[1] is not None
                        else:
                            compiler = cold if path == "whole, no cache" else native
                            xgr.GrammarMatcher(compiler.compile_structural_tag(grammar.tag_json))
                        values.append(time.perf_counter() - start)
                rows.append({"vocab": vocab_name, "tools": count, "allowed": allowed_count,
                             **{f"{path} ms": median_p90(values) for path, values in samples.items()},
                             "no cache / split": statistics.median(samples["whole, no cache"])
                             / statistics.median(samples["split"]),
                             "catalog compile ms": catalog_s * 1e3})
    return rows


def _first_seen(catalog, allowed, allowlist_digest: str, split: bool = True):
    """The request's grammar for a subset whose tags were never built (a new allowlist digest)."""
    common = dict(catalog_digest=f"catalog-{len(catalog)}", allowlist_digest=allowlist_digest,
                  mode="auto", parallel_tool_calls=True)
    tag = turn_tag("hermes", allowed, **common)
    halves = split_tags("hermes", catalog, allowed, **common) if split else None
    return read_extra_args(constraint_extra_args(tag, halves))


# ------------------------------------------------------------------------------------------ mask
def _answer(functions: list[AllowedFunction], rng: random.Random) -> str:
    function = functions[0]
    arguments: dict[str, Any] = {}
    for name, schema in function.parameters["properties"].items():
        arguments[name] = {"string": "src/main.py", "integer": 7, "array": ["a", "b"],
                           "object": {"recursive": True}}[schema["type"]]
        if "enum" in schema:
            arguments[name] = schema["enum"][0]
    return ('I will look that up.\n<tool_call>\n{"name": "' + function.name + '", "arguments": '
            + json.dumps(arguments) + '}\n</tool_call>')


def bench_mask(rounds: int) -> list[dict[str, Any]]:
    """Per generated token, one row, 4 of a 32-tool catalog allowed: the subset's own grammar
    (whole) and the catalog's grammar AND the envelope's (split), interleaved."""
    import torch
    tiny, tokenizer = tiny_tokenizer_info()
    large, index = synthetic_tokenizer_info()
    catalog = rich_functions(32)
    text = _answer(catalog, random.Random(0))
    rows = []
    for vocab_name, info, encode in (
            ("2K (tiny)", tiny, lambda t: tokenizer.encode(t, add_special_tokens=False)),
            ("150K (synthetic)", large, lambda t: greedy_encode(t, index))):
        tokens = encode(text)
        grammars = CompiledGrammars(info, upgrade=False)   # the split column stays split
        for mode in ("auto", "required"):
            answer = tokens if mode == "auto" else encode(text.split("\n", 1)[1])
            common = dict(catalog_digest="catalog-32", allowlist_digest="first-4", mode=mode,
                          parallel_tool_calls=True)
            tag = turn_tag("hermes", catalog[:4], **common)
            grammar = read_extra_args(constraint_extra_args(tag))
            split = read_extra_args(constraint_extra_args(tag, split_tags("hermes", catalog, catalog[:4],
                                                                          **common)))
            grammars.catalog(split.catalog)
            per_token: dict[str, list[float]] = {"whole": [], "split": []}
            for _ in range(rounds * 5):
                for name, request in (("whole", grammar), ("split", split)):
                    per_token[name] += _answer_step_times(grammars, request, answer, info)
            plain = MaskedBatch(grammars, info.vocab_size, max_rows=16)   # 16 rows, none constrained
            for row in range(16):
                plain.add(row, None, [], [])
            plain_logits = torch.zeros(16, info.vocab_size)

            def plain_step():
                plain.sync()
                plain.apply(plain_logits)
            rows.append({"vocab": vocab_name, "mode": mode, "tokens": len(answer),
                         **{f"{name} per token us": median_p90(values, scale=1e6)
                            for name, values in per_token.items()},
                         "plain_batch16_step_us": _timed(plain_step, 500) * 1e6,
                         **_apply_kernels(grammars, grammar, info.vocab_size)})
    return rows


def _answer_step_times(grammars: CompiledGrammars, grammar, answer: list[int], info) -> list[float]:
    """Each step's sync + mask over one whole answer, one row."""
    import torch
    output: list[int] = []
    batch = MaskedBatch(grammars, info.vocab_size, max_rows=1)
    batch.add(0, grammar, output, list(info.stop_token_ids))
    assert (batch.rows[0].envelope is not None) == (grammar.catalog is not None)
    logits = torch.zeros(1, info.vocab_size)
    times = []
    for token in answer:
        start = time.perf_counter()
        batch.sync()
        batch.apply(logits)
        times.append(time.perf_counter() - start)
        output.append(token)
    batch.sync()
    assert not batch.rows[0].failed, "the benchmark answer must be admissible"
    return times


def _apply_kernels(grammars: CompiledGrammars, grammar, vocab: int) -> dict[str, float]:
    """The bitmask application alone, CPU: xgrammar's kernel vs ours, interleaved."""
    import torch
    import xgrammar as xgr
    batch = MaskedBatch(grammars, vocab, max_rows=1)
    batch.add(0, grammar, [], [])
    batch.rows[0].matcher.fill_next_token_bitmask(batch._bitmask, 0)
    logits = torch.randn(1, vocab)
    theirs, ours = [], []
    for _ in range(200):
        start = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, batch._bitmask, vocab_size=vocab, indices=[0])
        theirs.append(time.perf_counter() - start)
        start = time.perf_counter()
        batch._apply_on_cpu(logits, [0], vocab)
        ours.append(time.perf_counter() - start)
    return {"apply_xgrammar_cpu_us": statistics.median(theirs) * 1e6,
            "apply_ours_cpu_us": statistics.median(ours) * 1e6}


# ------------------------------------------------------------------------------------------ decode
def bench_decode(rounds: int, tokens: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_allowed_tools.devtools.serve import MAX_MODEL_LEN, server_environment, template_for_parser
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    from vllm_allowed_tools.devtools.models.tool_pool import sample_catalog

    os.environ.update(server_environment())      # vLLM's CPU build settings, as serve-tiny uses
    model = ensure_model("tool-happy")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    template = template_for_parser("allowed_hermes").read_text()
    rng = random.Random(0)
    llm = LLM(model=str(model), dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True,
              block_size=32, max_num_seqs=32, enable_chunked_prefill=False,
              max_num_batched_tokens=MAX_MODEL_LEN, enable_prefix_caching=False,
              structured_outputs_config={"backend": "xgrammar"})
    tags: dict[tuple[int, str], tuple[str, Any, Any]] = {}
    subsets: dict[int, set[str]] = {}
    for index in range(16):
        catalog = sample_catalog(rng, 8)
        allowed = [tool.name for tool in rng.sample(catalog, 2)]
        for mode in ("auto", "required"):
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Go ahead ({index})."}],
                tools=[tool.chat_tool() for tool in catalog], tokenize=False, add_generation_prompt=True,
                chat_template=template,
                allowed_tools_policy={"mode": mode, "names": sorted(allowed)})
            everything = [AllowedFunction(t.name, t.parameters, True) for t in catalog]
            functions = [function for function in everything if function.name in allowed]
            common = dict(catalog_digest=f"catalog-{index}", allowlist_digest=f"subset-{index}",
                          mode=mode, parallel_tool_calls=True, max_whitespace=1)
            tags[(index, mode)] = (prompt, turn_tag("hermes", functions, **common),
                                   split_tags("hermes", everything, functions, **common))
            subsets[index] = set(allowed)
    variants = {   # the split's catalogs are compiled in the engine's background in the warm-up round
        "unconstrained": lambda tag, split: {},
        "native": lambda tag, split: {"structured_outputs": StructuredOutputsParams(structural_tag=tag.json)},
        "logits-processor": lambda tag, split: {"extra_args": constraint_extra_args(tag)},
        "logits-processor split": lambda tag, split: {"extra_args": constraint_extra_args(tag, split)},
    }
    timings: dict[tuple[str, str, int], list[float]] = {}
    compliance: dict[tuple[str, str, int], list[bool]] = {}
    for _ in range(rounds + 1):      # the first round warms up (compiles, caches) and is dropped
        for mode in ("auto", "required"):
            for batch in (1, 16):
                for name, extra in variants.items():
                    chosen = [tags[(i, mode)] for i in range(batch)]
                    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0,
                                             seed=i, **extra(tag, split))
                              for i, (_, tag, split) in enumerate(chosen)]
                    start = time.perf_counter()
                    outputs = llm.generate([prompt for prompt, _, _ in chosen], params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    made = sum(len(output.outputs[0].token_ids) for output in outputs)
                    timings.setdefault((mode, name, batch), []).append(made / elapsed)
                    obeyed = [_obeys(_until_stop(tokenizer, output.outputs[0].token_ids),
                                     subsets[i], mode) for i, output in enumerate(outputs)]
                    compliance.setdefault((mode, name, batch), []).extend(obeyed)
    rows = []
    for (mode, name, batch), samples in sorted(timings.items()):
        steady = statistics.median(samples[1:])
        base = statistics.median(timings[(mode, "unconstrained", batch)][1:])
        obeyed = compliance[(mode, name, batch)]
        rows.append({"mode": mode, "batch": batch, "variant": name, "tokens_per_s": steady,
                     "ratio_to_unconstrained": steady / base,
                     "answers_obeying_policy": sum(obeyed) / len(obeyed)})
    return rows


def _until_stop(tokenizer, token_ids) -> str:
    """The answer as a client gets it: up to the first stop token (``ignore_eos`` only keeps the
    request running so every variant makes the same number of tokens)."""
    ids = list(token_ids)
    if tokenizer.eos_token_id in ids:
        ids = ids[:ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids)


def _obeys(text: str, allowed: set[str], mode: str) -> bool:
    """Every complete hermes call names an allowed tool; required mode starts with a call."""
    import re
    names = re.findall(r'<tool_call>\s*\{"name": "([^"]+)"', text)
    if mode == "required" and not text.lstrip().startswith("<tool_call>"):
        return False
    return all(name in allowed for name in names)


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n## {title}")
    if not rows:
        return
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c])
                                for c in columns) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="all", choices=[
        "compile", "catalog-names", "subset", "mask", "decode", "outlines", "all"])
    parser.add_argument("--outlines-timeout", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if args.part in ("compile", "all"):
        _print("structural-tag compile (hermes, every tool allowed)", bench_compile(args.rounds))
    if args.part in ("catalog-names", "all"):
        _print("plain auto's catalog-names grammar (hermes, every tool, arguments any JSON object)",
               bench_compile(args.rounds, strict=False))
    if args.part in ("subset", "all"):
        _print("first-seen allowed subset of a known catalog: added latency, median / p90 (hermes)",
               bench_subset(args.rounds))
    if args.part in ("mask", "all"):
        _print("per-token mask cost, one row (matcher advance + bitmask fill + apply)",
               bench_mask(args.rounds))
    if args.part in ("decode", "all"):
        _print(f"decode throughput, tiny tool-happy model, {args.tokens} tokens per request",
               bench_decode(args.rounds, args.tokens))
    if args.part in ("outlines", "all"):
        from constraint_outlines import bench_outlines
        _print("outlines_core vs xgrammar, JSON-array required schema (mistral), one row",
               bench_outlines(args.rounds, args.outlines_timeout))


if __name__ == "__main__":
    main()
