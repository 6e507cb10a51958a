"""Digests anyone can reproduce: SHA-256 over RFC 8785 canonical JSON, the same value giving the same
digest however it is written; values RFC 8785 cannot represent hashed under a fallback instead of
failing; the rule and its worked example in docs/approvals.md equal to what the code computes (no
vLLM). Grants stored under the earlier rule: tests/test_approvals_upgrade.py."""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.approvals import arguments_digest, definition_digest
from vllm_allowed_tools.dispatch import InMemoryGrantChecker
from vllm_allowed_tools.dispatch import arguments_digest as dispatch_arguments_digest
from vllm_allowed_tools.request import (
    FunctionSpec,
    NotCanonicalJSON,
    ToolIdentity,
    canonical_json_bytes,
    text_digest,
    value_digest,
)

ROOT = Path(__file__).resolve().parents[1]
T0 = 1_800_000_000.0


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------------
# RFC 8785 itself


def test_the_rfc_8785_example_canonicalizes_as_the_rfc_prints_it() -> None:
    # RFC 8785, section 3.2.2: the input with its numbers, string escapes and literals
    text = ('{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
            ' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
            ' "literals": [null, true, false]}')
    expected = ('{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
                '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}')
    assert canonical_json_bytes(json.loads(text)) == expected.encode("utf-8")
    assert text_digest(text) == sha256(expected.encode("utf-8"))


def test_keys_sort_by_utf16_code_units_not_code_points() -> None:
    # RFC 8785, section 3.2.3: the emoji (a surrogate pair, D83D) sorts before U+FB33
    value = {"\u20ac": 1, "\r": 2, "\ufb33": 3, "1": 4, "\U0001f600": 5, "\u0080": 6, "\u00f6": 7}
    keys = list(json.loads(canonical_json_bytes(value)))
    assert keys == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]
    assert keys != sorted(value)  # Python's code point order puts U+FB33 before the emoji


@pytest.mark.parametrize(("number", "written"), [
    (1.0, "1"), (-0.0, "0"), (1e21, "1e+21"), (1e20, "100000000000000000000"), (1e-7, "1e-7"),
    (1e-6, "0.000001"), (5e-324, "5e-324"), (1.7976931348623157e308, "1.7976931348623157e+308"),
    (9007199254740991, "9007199254740991"), (-9007199254740991, "-9007199254740991"),
])
def test_numbers_are_written_as_ecmascript_writes_doubles(number: float, written: str) -> None:
    assert canonical_json_bytes([number]) == f"[{written}]".encode()


# --------------------------------------------------------------------------------------------------
# the digests, recomputed independently


def test_the_arguments_digest_is_sha256_of_the_rfc_8785_form_of_the_arguments() -> None:
    text = '{ "pr": 123,\n "body": "Gr\u00fc\u00dfe \U0001f44d", "w": 2.50, "tags": ["a", "b"] }'
    expected = "sha256:" + sha256(rfc8785.dumps(json.loads(text)))
    assert arguments_digest(text) == expected
    assert arguments_digest(json.loads(text)) == expected
    assert dispatch_arguments_digest(json.loads(text)) == expected.removeprefix("sha256:")


def test_the_definition_digest_is_sha256_of_the_rfc_8785_form_of_the_four_fields() -> None:
    params = {"type": "object", "properties": {"n": {"type": "number", "maximum": 10.0}}}
    spec = FunctionSpec.build(ToolIdentity("gh", "comment"), None, params, strict=True)
    obj = {"namespace": "gh", "name": "comment", "description": None, "parameters": params}
    assert definition_digest(spec) == "sha256:" + sha256(rfc8785.dumps(obj))
    bare = FunctionSpec.build(ToolIdentity(None, "ping"), "Ping.", None)
    assert definition_digest(bare) == "sha256:" + sha256(rfc8785.dumps(
        {"namespace": None, "name": "ping", "description": "Ping.",
         "parameters": {"type": "object", "properties": {}}}))


def test_numbers_equal_as_doubles_digest_equal_and_others_do_not() -> None:
    assert arguments_digest('{"x": 1}') == arguments_digest('{"x": 1.0}') \
        == arguments_digest('{"x": 1e0}') == arguments_digest('{"x": 10E-1}')
    assert arguments_digest('{"x": 0}') == arguments_digest('{"x": -0.0}')
    assert arguments_digest('{"x": 1}') != arguments_digest('{"x": "1"}')
    assert arguments_digest('{"x": 1}') != arguments_digest('{"x": 1.0000000001}')
    assert arguments_digest('{"x": true}') != arguments_digest('{"x": 1}')


_KEYS = st.text(max_size=6)
_SCALARS = (st.none() | st.booleans() | st.text(max_size=8)
            | st.integers(min_value=-(2**53 - 1), max_value=2**53 - 1)
            | st.floats(allow_nan=False, allow_infinity=False))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(_KEYS, inner, max_size=4), max_leaves=20)


def _shuffled(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: _shuffled(item, rng) for key, item in items}
    if isinstance(value, list):
        return [_shuffled(item, rng) for item in value]
    return value


@settings(max_examples=200, deadline=None)
@given(value=st.dictionaries(_KEYS, _JSON, max_size=5), seed=st.integers(0, 2**32 - 1),
       indent=st.sampled_from([None, 0, 2]))
def test_a_value_digests_as_its_reserialized_form_with_keys_shuffled(value: dict[str, Any], seed: int,
                                                                    indent: int | None) -> None:
    rng = random.Random(seed)
    text = json.dumps(_shuffled(value, rng), indent=indent, ensure_ascii=rng.random() < 0.5)
    assert arguments_digest(text) == arguments_digest(value)
    assert arguments_digest(json.dumps(json.loads(text))) == arguments_digest(value)
    assert value_digest(json.loads(text)) == value_digest(value)
    assert arguments_digest(value) == "sha256:" + sha256(rfc8785.dumps(value))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=-(2**53 - 1), max_value=2**53 - 1))
def test_an_integer_and_the_same_double_digest_equal(n: int) -> None:
    assert value_digest({"n": n}) == value_digest({"n": float(n)})
    assert arguments_digest(f'{{"n": {n}}}') == arguments_digest(f'{{"n": {float(n)!r}}}')


# --------------------------------------------------------------------------------------------------
# what RFC 8785 cannot represent: hashed under a fallback, never an error


@pytest.mark.parametrize("text", [
    '{"id": 18446744073709551615}', '{"id": 9007199254740993}', '{"x": 1e400}', '{"x": -1e400}',
    '{"s": "\\ud800"}', '{"\\udc00": 1}', '{"x": NaN}', '{"x": 1, "x": 2}', "not json",
])
def test_arguments_rfc_8785_cannot_represent_are_digested_over_their_exact_text(text: str) -> None:
    expected = "sha256:" + sha256(("raw:" + text).encode("utf-8", "surrogatepass"))
    assert arguments_digest(text) == expected
    assert arguments_digest(" " + text) != expected  # byte for byte: a space more is another call


def test_large_integers_are_never_rounded_into_one_digest() -> None:
    # 2**53 + 1 rounds to 2**53 as a double: rounding would let an approval of one id release another
    assert arguments_digest('{"id": 9007199254740993}') != arguments_digest('{"id": 9007199254740992}')
    assert arguments_digest('{"x": 1e400}') != arguments_digest('{"x": 2e400}')  # both overflow
    assert value_digest({"id": 2**64}) != value_digest({"id": 2**64 + 1})
    assert value_digest({"id": 2**64}) == sha256(b'python-json:{"id":18446744073709551616}')


def test_a_tool_definition_rfc_8785_cannot_represent_still_gets_a_digest() -> None:
    huge = {"type": "object", "properties": {"id": {"type": "integer", "maximum": 2**64 - 1}}}
    odd = [FunctionSpec.build(ToolIdentity(None, "t"), None, huge),
           FunctionSpec.build(ToolIdentity(None, "t"), "\ud800", None),
           FunctionSpec.build(ToolIdentity(None, "t"), None, {"type": "number", "maximum": float("inf")})]
    digests = {spec.digest for spec in odd}
    assert len(digests) == 3 and all(re.fullmatch("[0-9a-f]{64}", d) for d in digests)
    obj = {"namespace": None, "name": "t", "description": None, "parameters": huge}
    assert odd[0].digest == sha256(("python-json:" + json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)).encode("ascii"))


def test_the_dispatch_grant_of_a_large_id_releases_that_id_only() -> None:
    grants = InMemoryGrantChecker(clock=lambda: T0)
    tool = ToolIdentity(None, "get_tweet")
    grants.grant("alice", "s1", tool, arguments={"id": 1_450_000_000_000_000_001})
    assert grants.has_live_grant("alice", "s1", tool, {"id": 1_450_000_000_000_000_001})
    assert not grants.has_live_grant("alice", "s1", tool, {"id": 1_450_000_000_000_000_000})


@pytest.mark.parametrize(("value", "path", "says"), [
    ({"a": [1, {"b": 2**60}]}, "a[1].b", "send it as a string"),
    ({"x": float("nan")}, "x", "JSON cannot carry"),
    ({"s": ["ok", "x\udc00"]}, "s[1]", "unpaired surrogate"),
    ({"a b": {"k\ud800": 1}}, '["a b"]["k\\ud800"]', "unpaired surrogate"),
    ({1: 2}, "", "not a string"),
])
def test_the_canonicalizer_names_the_field_it_cannot_represent(value: Any, path: str, says: str) -> None:
    with pytest.raises(NotCanonicalJSON) as refused:
        canonical_json_bytes(value, name="arguments")
    assert refused.value.path == path
    assert str(refused.value).startswith("arguments" + ("." if path[:1].isalpha() else "") + path)
    assert says in str(refused.value)


# --------------------------------------------------------------------------------------------------
# the documented rule and example (docs/approvals.md, "Digests")


def _worked_example() -> tuple[list[str], list[str], dict[str, str]]:
    doc = (ROOT / "docs" / "approvals.md").read_text()
    found = re.search(r"\n### Worked example\n(.*?)(?=\n##)", doc, re.S)
    assert found, "docs/approvals.md has no '### Worked example' under 'Digests'"
    section = found.group(1)
    json_blocks = re.findall(r"```json\n(.*?)\n```", section, re.S)
    commands = re.findall(r"```sh\n(.*?)\n```", section, re.S)
    digests = dict(re.findall(r"`(arguments_digest|tool_definition_digest)`: `(sha256:[0-9a-f]{64})`",
                              section))
    assert len(json_blocks) == 4 and len(commands) == 2 and len(digests) == 2, section
    return json_blocks, commands, digests


def test_the_documented_worked_example_is_what_the_server_computes() -> None:
    (arguments, arguments_canonical, definition, definition_canonical), _, digests = _worked_example()
    assert canonical_json_bytes(json.loads(arguments)).decode() == arguments_canonical
    assert arguments_digest(arguments) == digests["arguments_digest"]
    obj = json.loads(definition)
    assert sorted(obj) == ["description", "name", "namespace", "parameters"]
    spec = FunctionSpec.build(ToolIdentity(obj["namespace"], obj["name"]), obj["description"],
                              obj["parameters"])
    assert canonical_json_bytes(obj).decode() == definition_canonical
    assert definition_digest(spec) == digests["tool_definition_digest"]


def test_the_documented_commands_print_the_documented_digests() -> None:
    _, commands, digests = _worked_example()
    printed = []
    for command in commands:
        assert "| python -c " in command
        run = subprocess.run(["sh", "-c", command.replace("| python -c ", f"| {sys.executable} -c ")],
                             capture_output=True, text=True, timeout=60, check=True)
        printed.append(run.stdout.strip())
    assert printed == [digests["arguments_digest"], digests["tool_definition_digest"]]
