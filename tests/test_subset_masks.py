"""The split grammar (catalog AND envelope) admits exactly what the turn's own grammar admits.

Random catalogs (names that are prefixes of each other, strict and loose schemas), random subsets,
modes and ``parallel_tool_calls``, for a JSON-argument format (hermes), an XML-argument format
(qwen3_coder), a JSON-array format (mistral) and an xgrammar builtin (llama3_json). Each example
decodes one answer through :class:`MaskedBatch` with two rows fed the same tokens: row 0 carries
the whole grammar, row 1 the split one; at every step both rows must mask the same tokens. Tokens
are drawn from the allowed ones with a bias towards markup, so answers reach names and arguments.
"""

from __future__ import annotations

import random
import threading
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

from vllm_allowed_tools.decode.grammar import AllowedFunction, turn_tag  # noqa: E402
from vllm_allowed_tools.decode.masks import CompiledGrammars, MaskedBatch  # noqa: E402
from vllm_allowed_tools.decode.split import split_for_request, split_tags  # noqa: E402
from vllm_allowed_tools.decode.split import constraint_extra_args
from vllm_allowed_tools.decode.stage import read_extra_args  # noqa: E402
from vllm_allowed_tools.formats import wire_format  # noqa: E402

NAMES = ["get", "get_user", "get_users", "set", "search", "search_web", "run", "read", "read_file"]
PIECES = ["<tool_call>", "</tool_call>", "<tool_call>\n", '{"', '"}', '": ', '", "', '"name"', "name",
          '"arguments"', "arguments", "<function=", "<parameter=", "</parameter>", "</function>",
          "[TOOL_CALLS]", '[{"', "true", "false", "null", "path", "mode", "limit", "fast", "safe",
          "src/main.py", "<|python_tag|>", '{"name": "', '"parameters"', "parameters", *NAMES]
MARKUP = set('<>{}[]"=:,\n')


def _vocabulary():
    import xgrammar as xgr
    vocab = list(dict.fromkeys([*string.printable, *PIECES]))
    vocab.append("<|endoftext|>")
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab),
                             stop_token_ids=[len(vocab) - 1])
    return info, vocab


INFO, VOCAB = _vocabulary()
GRAMMARS = CompiledGrammars(INFO, capacity=64, catalog_capacity=64, upgrade=False)   # splits stay split

SCHEMA_PARTS = {
    "path": {"type": "string"},
    "mode": {"type": "string", "enum": ["fast", "safe"]},
    "limit": {"type": "integer", "minimum": 1, "maximum": 99},
    "flag": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
}


@st.composite
def turns(draw, formats):
    names = draw(st.lists(st.sampled_from(NAMES), min_size=2, max_size=6, unique=True))
    catalog = []
    for name in names:
        keys = draw(st.lists(st.sampled_from(sorted(SCHEMA_PARTS)), min_size=1, max_size=3, unique=True))
        parameters = {"type": "object", "properties": {key: SCHEMA_PARTS[key] for key in keys},
                      "required": keys[:1], "additionalProperties": False}
        catalog.append(AllowedFunction(name, parameters, draw(st.sampled_from([True, False, None]))))
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    allowed = [function for function in catalog if function.name in chosen]
    return {"format": draw(st.sampled_from(formats)), "catalog": catalog, "allowed": allowed,
            "mode": draw(st.sampled_from(["auto", "required"])), "parallel": draw(st.booleans()),
            "strict_level": draw(st.sampled_from([1, 2])), "whitespace": draw(st.sampled_from([1, 2, None])),
            "rng": random.Random(draw(st.integers(0, 2**32)))}


def _tags(turn):
    common = dict(catalog_digest="catalog:" + repr([(f.name, f.parameters) for f in turn["catalog"]]),
                  allowlist_digest="subset:" + ",".join(f.name for f in turn["allowed"]),
                  mode=turn["mode"], parallel_tool_calls=turn["parallel"],
                  max_whitespace=turn.get("whitespace", 1))
    whole = turn_tag(turn["format"], turn["allowed"], strict_level=turn["strict_level"], **common)
    split = split_tags(turn["format"], turn["catalog"], turn["allowed"],
                       strict_level=turn["strict_level"], **common)
    if whole is None:
        return None, split
    # what the parser wrapper offers: the split of exactly this tag (where both strict levels build
    # the same tag, the catalog of either level is as good: they differ only in tools not allowed)
    offered = split_for_request(turn["format"], whole.json, turn["catalog"], turn["allowed"], **common)
    assert (offered is None) == (split is None)
    return whole, offered


def _pick(rng: random.Random, allowed: list[int], step: int) -> int:
    stop = len(VOCAB) - 1
    if stop in allowed and (len(allowed) == 1 or rng.random() < step / 400):
        return stop
    candidates = [token for token in allowed if token != stop]
    markup = [token for token in candidates if MARKUP & set(VOCAB[token]) or VOCAB[token] in NAMES]
    if markup and rng.random() < 0.7:
        return rng.choice(markup)
    return rng.choice(candidates)


def _decode_both(turn) -> int:
    """Decode one answer with the whole grammar (row 0) and the split (row 1); returns the steps."""
    whole, split = _tags(turn)
    # a JSON-array format's auto turn (a dispatch or a trigger before the array) is not split
    unsplit = wire_format(turn["format"]).grammar.kind == "json_array" and turn["mode"] == "auto"
    if whole is None or unsplit:
        assert split is None
        return 0
    assert split is not None
    GRAMMARS.catalog(read_extra_args(constraint_extra_args(whole, split)).catalog)   # compiled now
    batch = MaskedBatch(GRAMMARS, len(VOCAB), max_rows=2)
    outputs: tuple[list[int], list[int]] = ([], [])
    batch.add(0, read_extra_args(constraint_extra_args(whole)), outputs[0])
    batch.add(1, read_extra_args(constraint_extra_args(whole, split)), outputs[1])
    assert batch.rows[0].envelope is None and batch.rows[1].envelope is not None
    rng = turn["rng"]
    for step in range(120):
        batch.sync()
        assert not batch.rows[0].failed and not batch.rows[1].failed
        if batch.rows[0].matcher.is_terminated():
            assert batch.rows[1].matcher.is_terminated()
            return step
        logits = torch.zeros(2, len(VOCAB))
        batch.apply(logits)
        refused = torch.isinf(logits)
        assert torch.equal(refused[0], refused[1]), \
            f"masks differ after {[VOCAB[t] for t in outputs[0]]!r}"
        allowed = torch.nonzero(~refused[0]).flatten().tolist()
        assert allowed, "the grammar left no token"
        token = _pick(rng, allowed, step)
        outputs[0].append(token)
        outputs[1].append(token)
    return 120


PROFILE = settings(derandomize=True, deadline=None, max_examples=40, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROFILE
@given(turns(["hermes"]))
def test_hermes_split_masks_equal_the_subset_grammar(turn):
    _decode_both(turn)


@PROFILE
@given(turns(["qwen3_coder"]))
def test_xml_argument_split_masks_equal_the_subset_grammar(turn):
    _decode_both(turn)


@settings(PROFILE, max_examples=20)
@given(turns(["mistral", "llama3_json", "longcat"]))
def test_other_formats_split_masks_equal_the_subset_grammar(turn):
    _decode_both(turn)


def test_answers_reach_calls():
    """The walk is biased enough to decode whole calls (else the properties would test little)."""
    rng = random.Random(0)
    catalog = [AllowedFunction(name, {"type": "object", "properties": {"path": {"type": "string"}},
                                      "required": ["path"], "additionalProperties": False}, True)
               for name in NAMES[:4]]
    steps = _decode_both({"format": "hermes", "catalog": catalog, "allowed": catalog[1:3],
                          "mode": "required", "parallel": False, "strict_level": 1, "rng": rng})
    assert 5 < steps < 120


def test_a_new_catalog_keeps_the_whole_grammar_until_compiled():
    """The first request of a catalog is constrained by its own grammar while the catalog compiles
    in the background; once compiled, a new subset's request gets the catalog and its envelope,
    and a subset whose own grammar is compiled gets that alone."""
    catalog = [AllowedFunction(name, {"type": "object"}, True) for name in ("alpha", "beta", "gamma")]
    grammars = CompiledGrammars(INFO, lazy=False)   # the split path (llguidance: test_lazy_grammars)

    def request(allowed):
        common = dict(catalog_digest="a-new-catalog", allowlist_digest="+".join(f.name for f in allowed),
                      mode="auto", parallel_tool_calls=True)
        return read_extra_args(constraint_extra_args(turn_tag("hermes", allowed, **common),
                                                     split_tags("hermes", catalog, allowed, **common)))

    grammar = request(catalog[1:2])
    envelope = grammars.matchers(grammar).envelope
    assert envelope is None
    assert grammars.catalog(grammar.catalog) is not None        # waits for the background compile
    envelope = grammars.matchers(request(catalog[:2])).envelope
    assert envelope is not None
    envelope = grammars.matchers(grammar).envelope                     # its own grammar is compiled
    assert envelope is None


def test_a_split_row_continues_on_its_own_grammar_once_compiled():
    """A row that starts on the catalog and its envelope moves to its subset's own grammar when the
    background compile finishes, mid-answer, and masks exactly as before."""
    catalog = [AllowedFunction(name, {"type": "object", "properties": {"path": {"type": "string"}},
                                      "required": ["path"], "additionalProperties": False}, True)
               for name in NAMES[:4]]
    allowed = catalog[1:3]
    common = dict(catalog_digest="upgrade-catalog", allowlist_digest="upgrade-subset", mode="required",
                  parallel_tool_calls=False)
    whole = turn_tag("hermes", allowed, **common)
    split = split_tags("hermes", catalog, allowed, **common)
    grammars = CompiledGrammars(INFO, lazy=False)   # the split path (llguidance: test_lazy_grammars)
    grammars.catalog(read_extra_args(constraint_extra_args(whole, split)).catalog)
    reference = CompiledGrammars(INFO, upgrade=False)
    hold = threading.Event()     # the background thread waits, so the compile lands at step 2
    grammars._worker.submit(hold.wait)
    upgraded = MaskedBatch(grammars, len(VOCAB), max_rows=1)
    plain = MaskedBatch(reference, len(VOCAB), max_rows=1)
    outputs: tuple[list[int], list[int]] = ([], [])
    upgraded.add(0, read_extra_args(constraint_extra_args(whole, split)), outputs[0])
    plain.add(0, read_extra_args(constraint_extra_args(whole)), outputs[1])
    assert upgraded.rows[0].envelope is not None
    rng, moved_at = random.Random(3), None
    for step in range(60):
        upgraded.sync()
        plain.sync()
        if moved_at is None and upgraded.rows[0].envelope is None:
            moved_at = step
        if plain.rows[0].matcher.is_terminated():
            assert upgraded.rows[0].matcher.is_terminated()
            break
        masks = [torch.zeros(1, len(VOCAB)), torch.zeros(1, len(VOCAB))]
        upgraded.apply(masks[0])
        plain.apply(masks[1])
        assert torch.equal(torch.isinf(masks[0]), torch.isinf(masks[1]))
        token = _pick(rng, torch.nonzero(~torch.isinf(masks[1][0])).flatten().tolist(), step)
        outputs[0].append(token)
        outputs[1].append(token)
        if step == 2:   # the background compile of the subset's own grammar, finished now
            hold.set()
            grammars._in_background(upgraded.rows[0].grammar, grammars._compile_own).result()
    assert moved_at == 3 and not upgraded.rows[0].failed


def test_a_catalog_that_does_not_hash_to_its_digest_is_never_used():
    catalog = [AllowedFunction(name, {"type": "object"}, True) for name in ("alpha", "beta")]
    common = dict(catalog_digest="planted", allowlist_digest="alpha", mode="required",
                  parallel_tool_calls=True)
    whole = turn_tag("hermes", catalog[:1], **common)
    split = split_tags("hermes", catalog, catalog[:1], **common)
    args = constraint_extra_args(whole, split)
    grammars = CompiledGrammars(INFO, lazy=False)   # the split path (llguidance: test_lazy_grammars)
    planted = read_extra_args({**args, "vllm_allowed_tools_catalog_tag": whole.json}, verify=False)
    assert grammars.catalog(planted.catalog) is None
    envelope = grammars.matchers(planted).envelope
    assert envelope is None


@pytest.mark.parametrize("parser", ["allowed_hermes", "allowed_qwen3_coder"])
@pytest.mark.parametrize("mode", ["auto", "required"])
def test_the_parser_wrapper_hands_the_split_to_the_logits_processor(monkeypatch, parser, mode):
    """On the logits-processor stage the wrapper sends the whole tag and its split: the catalog's
    grammar names every tool of the catalog, the envelope only the allowed ones."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    from vllm_allowed_tools.settings import STAGE_LOGITS_PROCESSOR
    from vllm_allowed_tools.request.rewrite import rewrite_request
    from support.calls import chat_selection
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
    from vllm_allowed_tools.vllm_glue import parsers
    from vllm_allowed_tools.vllm_glue.plugin import register

    register()
    monkeypatch.setattr(parsers, "active_constraint_stage", lambda: STAGE_LOGITS_PROCESSOR)
    names = sorted(POOL_BY_NAME)[:6]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "tools": [POOL_BY_NAME[name].chat_tool() for name in names],
            "tool_choice": chat_selection(mode, names[1:3])}
    request = ChatCompletionRequest(**rewrite_request(body, "chat").body)
    wrapper = ToolParserManager.get_tool_parser(parser)(
        AutoTokenizer.from_pretrained(str(ensure_model("random"))))
    grammar = read_extra_args(wrapper.adjust_request(request).vllm_xargs)
    assert grammar.catalog is not None and grammar.envelope is not None
    assert all(name in grammar.catalog.tag_json for name in names)
    assert [name for name in names if name in grammar.envelope.tag_json] == names[1:3]


def test_no_split_without_an_allowed_tool_or_for_another_tag():
    catalog = [AllowedFunction(name, {"type": "object"}, True) for name in ("alpha", "beta")]
    common = dict(catalog_digest="c", allowlist_digest="a", mode="auto", parallel_tool_calls=True)
    whole = turn_tag("hermes", catalog[:1], **common)
    assert split_for_request("hermes", whole.json, catalog, [], **common) is None
    other = turn_tag("hermes", catalog[1:], **{**common, "allowlist_digest": "b"})
    assert split_for_request("hermes", other.json, catalog, catalog[:1], **common) is None
    assert split_for_request("hermes", "not json", catalog, catalog[:1], **common) is None
    assert split_for_request("hermes", whole.json, catalog, catalog[:1], **common) is not None


def test_a_full_background_queue_leaves_new_subsets_on_their_split():
    """Past ``PENDING_LIMIT`` waiting compiles no subset's own grammar is queued: its rows keep the
    catalog and the envelope (which admit the same), so a burst of new subsets cannot queue without
    end."""
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    catalog = [AllowedFunction(name, schema, True) for name in ("alpha", "beta", "gamma")]
    common = dict(catalog_digest="queue-catalog", allowlist_digest="queue-subset", mode="auto",
                  parallel_tool_calls=True)
    grammar = read_extra_args(constraint_extra_args(turn_tag("hermes", catalog[:1], **common),
                                                    split_tags("hermes", catalog, catalog[:1], **common)))
    grammars = CompiledGrammars(INFO, lazy=False)   # the split path (llguidance: test_lazy_grammars)
    grammars.catalog(grammar.catalog)
    grammars.PENDING_LIMIT = 0
    assert grammars.matchers(grammar)[1] is not None
    grammars._worker.submit(lambda: None).result()      # anything queued before has run
    assert grammars.ready(grammar) is None and grammars.matchers(grammar)[1] is not None
