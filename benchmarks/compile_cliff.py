"""The compile on a first-seen request's critical path at a 150K vocabulary when its tools' schemas
hold string ``maxLength`` bounds, patterns, deep nesting, large enums and ``anyOf`` trees: the
options side by side.

    python benchmarks/compile_cliff.py [--samples 10] [--cliff-samples 1] [--mode required|auto] [--forms]
        [--xgrammar-path DIR]

The catalog: the MCP-shaped templates (``benchmarks/mcp_tools.py``: Slack's ``post_message`` with a
40,000 ``maxLength`` text and a channel ``pattern``, a web search's 400-character query, a ticket's
255-character summary, a time ``pattern``, GitHub's nested review comments) and three shapes written
here from what MCP servers publish: a database query whose filter is an ``anyOf`` tree, a
calendar event with a 420-value time-zone enum, and a project board's five-deep nesting. Every tool
is ``strict``. The request: hermes, ``required`` (``--mode auto``: a policy ``auto`` turn, free text
between the calls), 4 allowed tools (Slack, search, the filter tree,
the time-zone enum). What is timed, median of ``--samples``, each with a cold cache (a first-seen
catalog: nothing of its schemas compiled before):

* logits-processor stage, first-seen catalog: the request's own grammar compiled (the catalog's
  compiles in the background: ``decode/compiled.py``) and its matcher made;
* logits-processor stage, first-seen subset of a compiled catalog: the split's envelope;
* native stage: vLLM's xgrammar backend compiling the request's structural tag (a fresh compiler,
  8 threads, cache on, as vLLM builds it);
* what ships on the logits-processor stage: the row starts on llguidance's matcher for the tag's
  translation (``decode/lazy_grammars.py``) while xgrammar compiles in the background: the
  matcher and its first mask, then a mask a token;
* the native stage on vLLM's guidance backend with the plugin's hook: the API server's validation
  of the tag and the engine's matcher for it with its first mask;

each with the strict tools' string lengths in the grammar (what xgrammar 0.2.8 made of them) and as
shipped (left to the guard while xgrammar compiles them slowly: ``decode/argument_schemas.py``);
next to llguidance (in vLLM's environment): a matcher for each allowed tool's full schema, lengths
included, and its first mask (llguidance computes masks lazily, per token, nothing ahead).
``--xgrammar-path DIR``: the native stage with lengths once more, importing xgrammar from ``DIR``
(``pip install --no-deps --target DIR xgrammar==0.2.9``; vLLM 0.32 pins 0.2.8). ``--forms``: a bare
bounded string written several ways in xgrammar's EBNF. Nothing is asserted: docs/benchmarks.md
records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grammar_inputs import synthetic_tokenizer_info  # noqa: E402
from mcp_tools import _obj, mcp_catalog  # noqa: E402

from vllm_allowed_tools.decode import argument_schemas  # noqa: E402
from vllm_allowed_tools.decode.argument_slots import clear_slot_cache  # noqa: E402
from vllm_allowed_tools.decode.grammar import AllowedFunction, clear_tag_cache, turn_tag  # noqa: E402
from vllm_allowed_tools.decode.split import constraint_extra_args, split_tags  # noqa: E402
from vllm_allowed_tools.decode.stage import read_extra_args  # noqa: E402

_ZONES = [f"{region}/{city}" for region in ("Africa", "America", "Asia", "Atlantic", "Australia",
                                            "Europe", "Indian", "Pacific", "Antarctica", "Arctic")
          for city in ("Abidjan", "Accra", "Algiers", "Bissau", "Cairo", "Ceuta", "Dakar", "Juba",
                       "Lagos", "Lome", "Maputo", "Maseru", "Niamey", "Tunis", "Adak", "Anchorage",
                       "Aruba", "Bahia", "Belem", "Belize", "Bogota", "Boise", "Cancun", "Cayenne",
                       "Chicago", "Denver", "Detroit", "Havana", "Jamaica", "Juneau", "La_Paz",
                       "Lima", "Manaus", "Merida", "Moncton", "Nome", "Panama", "Recife")
          ] + ["UTC", "Etc/GMT+1", "Etc/GMT-1"]
_FILTER_LEAF = {"type": "object", "additionalProperties": False, "required": ["property"],
                "properties": {"property": {"type": "string", "maxLength": 100},
                               "equals": {"anyOf": [{"type": "string"}, {"type": "number"},
                                                    {"type": "boolean"}]},
                               "contains": {"type": "string", "maxLength": 2000},
                               "before": {"type": "string", "format": "date"}}}
_FILTER_AND = {"type": "object", "additionalProperties": False, "required": ["and"],
               "properties": {"and": {"type": "array", "items": _FILTER_LEAF, "maxItems": 10}}}
_FILTER_OR = {"type": "object", "additionalProperties": False, "required": ["or"],
              "properties": {"or": {"type": "array", "maxItems": 10,
                                    "items": {"anyOf": [_FILTER_LEAF, _FILTER_AND]}}}}


def _nested(depth: int) -> dict[str, Any]:
    if depth == 0:
        return _obj({"title": {"type": "string", "maxLength": 256},
                     "done": {"type": "boolean"}}, ["title"])
    return _obj({"name": {"type": "string", "minLength": 1, "maxLength": 128},
                 "children": {"type": "array", "items": _nested(depth - 1)}}, ["name"])


#: shapes beyond mcp_tools' templates: an anyOf tree, a large enum, deep nesting
EXTRA = [
    ("notion__query_database", _obj({
        "database_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
        "filter": {"anyOf": [_FILTER_LEAF, _FILTER_AND, _FILTER_OR]},
        "page_size": {"type": "integer", "minimum": 1, "maximum": 100}}, ["database_id"])),
    ("calendar__create_event", _obj({
        "summary": {"type": "string", "maxLength": 1024},
        "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"},
        "timeZone": {"type": "string", "enum": _ZONES},
        "attendees": {"type": "array", "items": _obj({"email": {"type": "string", "format": "email"},
                                                      "optional": {"type": "boolean"}}, ["email"])}},
        ["summary", "start", "end"])),
    ("board__create_project", _obj({"project": _nested(4)}, ["project"])),
]
ALLOWED = ("slack__post_message", "search__web_search", "notion__query_database", "calendar__create_event")


def catalog() -> list[AllowedFunction]:
    tools = [AllowedFunction(t["function"]["name"], t["function"]["parameters"], True)
             for t in mcp_catalog(21)]
    return tools + [AllowedFunction(name, parameters, True) for name, parameters in EXTRA]


#: the turn's mode (``--mode``): ``auto`` is a policy turn, its free text between the calls
MODE = "required"


def _tags(functions: list[AllowedFunction], lengths_in_grammar: bool, salt: str):
    """(the turn's whole tag, its split) with strict lengths in the grammar or left to the guard;
    an ``auto`` turn's marked as a policy turn's, as the wrapper marks it."""
    argument_schemas._FAST_LENGTHS = lengths_in_grammar
    clear_tag_cache()
    clear_slot_cache()
    allowed = [f for f in functions if f.name in ALLOWED]
    common = dict(catalog_digest=f"cliff-{salt}", allowlist_digest=f"subset-{salt}", mode=MODE,
                  parallel_tool_calls=True)
    whole = turn_tag("hermes", allowed, **common)
    split = split_tags("hermes", functions, allowed, **common)
    return whole, read_extra_args(constraint_extra_args(whole, split, utf8_text=MODE == "auto"))


def _timed(run, samples: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, times


def xgrammar_arms(info: Any, lengths_in_grammar: bool, samples: int) -> dict[str, float]:
    import xgrammar as xgr

    from vllm_allowed_tools.decode.masks import CompiledGrammars
    functions = catalog()
    whole, grammar = _tags(functions, lengths_in_grammar, f"{lengths_in_grammar}")
    rows = {}

    def own_grammar():
        grammars = CompiledGrammars(info, upgrade=False)     # cold: a first-seen catalog
        xgr.GrammarMatcher(grammars.get(grammar))
    rows["logits-processor stage, first-seen catalog"] = _timed(own_grammar, samples)[0]
    compiled_catalog = CompiledGrammars(info, upgrade=False).catalog(grammar.catalog)   # once

    def new_subset():
        known = CompiledGrammars(info, upgrade=False)       # the envelope unseen, cache cold
        known._cache.put(grammar.catalog.digest, compiled_catalog, 1)
        start = time.perf_counter()
        assert known.matchers(grammar)[1] is not None
        return time.perf_counter() - start
    envelope = [new_subset() for _ in range(samples)]
    rows["logits-processor stage, first-seen subset"] = statistics.median(envelope) * 1e3

    def native():
        xgr.GrammarCompiler(info, max_threads=8, cache_enabled=True).compile_structural_tag(whole.json)
    rows["native stage, first-seen catalog"] = _timed(native, samples)[0]
    return rows


def shipped_arm(info: Any, samples: int, steps: int = 200) -> dict[str, float]:
    """What ships on the logits-processor stage (``VLLM_ALLOWED_TOOLS_FIRST_SEEN_GRAMMARS``
    ``llguidance``): a first-seen catalog's row gets llguidance's matcher for the translated tag
    and its first mask (ms, median, each sample a grammar never seen: its translation cold), the
    background xgrammar compile left out of the timing (it runs in its own thread); then a mask a
    token over ``steps`` random allowed tokens (µs, median and max); and llguidance's tokenizer,
    built once per server in the background at start-up (s)."""
    import random

    import xgrammar as xgr

    from vllm_allowed_tools.decode.masks import CompiledGrammars
    functions = catalog()
    started = time.perf_counter()
    grammars = CompiledGrammars(info, lazy=True)
    grammars.lazy._ready.wait()
    tokenizer_s = time.perf_counter() - started
    grammars._in_background = lambda grammar, compile_it: None   # timed on its own, above
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    tags = [_tags(functions, False, f"shipped-{sample}")[1] for sample in range(samples)]

    def first(grammar: Any) -> Any:
        row = grammars.matchers(grammar)
        row.matcher.fill_next_token_bitmask(bitmask, 0)
        return row.matcher
    times = []
    for grammar in tags:
        begun = time.perf_counter()
        matcher = first(grammar)
        times.append(time.perf_counter() - begun)
    assert type(matcher).__name__ == "LazyMatcher"
    rng = random.Random(0)
    masks = []
    for _ in range(steps):
        words = bitmask[0].numpy()
        allowed = [i for i in range(info.vocab_size) if (int(words[i >> 5]) >> (i & 31)) & 1]
        if not allowed or matcher.is_terminated():
            break
        if not matcher.accept_token(rng.choice(allowed)):
            break
        begun = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        masks.append(time.perf_counter() - begun)
    return {"first-seen catalog, llguidance matcher + first mask ms": statistics.median(times) * 1e3,
            "mask a token, median us": statistics.median(masks) * 1e6,
            "mask a token, max ms": max(masks) * 1e3, "tokens masked": len(masks),
            "llguidance tokenizer at start-up s": tokenizer_s}


def guidance_arm(info: Any, samples: int) -> dict[str, float]:
    """The native stage on vLLM's guidance backend, hooked (``vllm_glue/guidance_tags.py``): what
    a first-seen tag costs on the request's path, each sample a tag never seen: the API server's
    validation (the tag's translation, llguidance's check of it) and the engine's matcher for it
    (translated again, over xgrammar's reading of the vocabulary) with its first mask; with the
    strict tools' lengths left to the guard (as shipped) and in the grammar."""
    import llguidance
    import llguidance.torch

    from vllm_allowed_tools.decode.lazy_grammars import LazyGrammars
    from vllm_allowed_tools.vllm_glue import guidance_tags
    grammars = LazyGrammars(info)
    tokenizer = grammars.tokenizer()     # once per server, at its first structured request
    bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    rows = {}
    for label, lengths in (("native stage on guidance, first-seen catalog", False),
                           ("the same, lengths in the grammar", True)):
        tags = [_tags(catalog(), lengths, f"guidance-{lengths}-{sample}")[0].json for sample in range(samples)]
        times = []
        for tag in tags:
            begun = time.perf_counter()
            lark = guidance_tags.translated_tag(tag)                     # API server: validation
            assert not llguidance.LLMatcher.validate_grammar(lark, None)
            guidance_tags._TRANSLATIONS.clear()                          # the engine's own process
            matcher = guidance_tags.tag_matcher(grammars, guidance_tags.translated_tag(tag))
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - begun)
            assert not matcher.is_error()
        rows[label] = statistics.median(times) * 1e3
    return rows


def llguidance_arm(index: dict[str, int], samples: int) -> float:
    """A matcher for each allowed tool's full schema and its first mask (ms, median)."""
    import llguidance
    from grammar_inputs import greedy_encode
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    vocab = sorted(index, key=index.get)

    class Wrapped:
        eos_token_id, bos_token_id = len(vocab) - 1, None
        tokens = [token.encode() for token in vocab]
        special_token_ids = [len(vocab) - 1]

        def __call__(self, text):
            return greedy_encode(text.decode() if isinstance(text, bytes) else text, index)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))
    grammars = [llguidance.LLMatcher.grammar_from_json_schema(f.parameters)
                for f in catalog() if f.name in ALLOWED]
    mask = allocate_token_bitmask(1, len(vocab))

    def run():
        for grammar in grammars:
            matcher = llguidance.LLMatcher(tokenizer, grammar)
            fill_next_token_bitmask(matcher, mask)
            assert not matcher.is_error(), matcher.get_error()
    return _timed(run, samples)[0]


FORMS = {
    "JSON schema maxLength 400": None, "JSON schema maxLength 40000": None,
    "JSON schema, no maxLength": None,
    '[^"\\\\]{0,3}': 'root ::= "\\"" [^"\\\\\\r\\n]{0,3} "\\""',
    '[^"\\\\]{0,20}': 'root ::= "\\"" [^"\\\\\\r\\n]{0,20} "\\""',
    '[^"\\\\]{0,400}': 'root ::= "\\"" [^"\\\\\\r\\n]{0,400} "\\""',
    '[^"\\\\]{400} (exact)': 'root ::= "\\"" [^"\\\\\\r\\n]{400} "\\""',
    '([^"\\\\]{0,20}){0,20}': 'root ::= "\\"" ([^"\\\\\\r\\n]{0,20}){0,20} "\\""',
    "a rule, c{0,400}": 'root ::= "\\"" c{0,400} "\\""\nc ::= [^"\\\\\\r\\n]',
    "[a-zA-Z0-9]{0,400} (narrow class)": 'root ::= "\\"" [a-zA-Z0-9]{0,400} "\\""',
    '[^"\\\\]* (unbounded)': 'root ::= "\\"" [^"\\\\\\r\\n]* "\\""',
}


def forms(info: Any) -> dict[str, float]:
    """A bare bounded string, each way once, one thread, cache off (ms)."""
    import xgrammar as xgr
    out = {}
    for label, ebnf in FORMS.items():
        if ebnf is None:
            bound = {"JSON schema maxLength 400": 400, "JSON schema maxLength 40000": 40000}.get(label)
            ebnf = xgr.Grammar.from_json_schema(json.dumps(
                {"type": "string", **({"maxLength": bound} if bound else {})}))
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        out[label] = _timed(lambda: compiler.compile_grammar(ebnf), 1)[0]
        print(f"  {label}: {out[label]:.0f} ms", flush=True)
    return out


def other_xgrammar(path: str, samples: int) -> dict[str, Any]:
    """The native stage with lengths in the grammar, under the xgrammar found at ``path``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, "--native-lengths-only", "--samples", str(samples)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--mode", choices=("required", "auto"), default="required",
                        help="the turn's mode (auto: a policy turn, free text between the calls)")
    parser.add_argument("--cliff-samples", type=int, default=1,
                        help="samples with lengths in an 0.2.8 grammar")
    parser.add_argument("--forms", action="store_true")
    parser.add_argument("--xgrammar-path")
    parser.add_argument("--native-lengths-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    global MODE
    MODE = args.mode
    import xgrammar as xgr
    info, index = synthetic_tokenizer_info(150_000)
    if args.native_lengths_only:
        whole, _ = _tags(catalog(), True, "other")
        median, _ = _timed(lambda: xgr.GrammarCompiler(info, max_threads=8, cache_enabled=True)
                           .compile_structural_tag(whole.json), args.samples)
        print(json.dumps({"xgrammar": argument_schemas._installed_xgrammar(),
                          "native stage, first-seen catalog": median}))
        return 0
    result: dict[str, Any] = {"xgrammar": argument_schemas._installed_xgrammar(), "vocabulary": 150_000,
                              "samples": args.samples, "mode": MODE}
    if args.forms:
        result["forms ms"] = forms(info)
    result["shipped: llguidance first"] = shipped_arm(info, args.samples)
    print(result, flush=True)
    result["native stage on guidance ms"] = guidance_arm(info, args.samples)
    print(result, flush=True)
    result["lengths left to the guard ms"] = xgrammar_arms(info, False, args.samples)
    print(result, flush=True)
    result["llguidance, lazy masks ms"] = llguidance_arm(index, args.samples)
    print(result, flush=True)
    if args.xgrammar_path:
        result["other xgrammar, lengths in the grammar"] = other_xgrammar(args.xgrammar_path, args.samples)
        print(result, flush=True)
    if args.cliff_samples:
        result["lengths in the grammar ms"] = xgrammar_arms(info, True, args.cliff_samples)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
