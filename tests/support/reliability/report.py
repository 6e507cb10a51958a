"""The figures of a reliability run: what each part counts, and the markdown tables the benchmark
prints from them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Figures:
    """Counts of one part of the run; `problems` holds a description of everything that was wrong."""
    counts: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {**dict(sorted(self.counts.items())), **self.extra,
                "problems": len(self.problems)}


def _median(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _fuzz_row(fuzz: Figures) -> str:
    c = fuzz.counts
    known = sum(v for k, v in c.items() if k.startswith("known_bug:"))
    details = (f"4xx: {c['4xx_plugin']} from the plugin (exact param), {c['4xx_vllm']} from vLLM, "
               f"{c['4xx_without_field']} without a field ({known} on known bugs, below); "
               f"{c['unexpected_outcome']} unexpected status; {c['calls_returned']} calls "
               f"returned; {c['with_custom_tools']} requests with custom tools, "
               f"{c['custom_inputs_leaked']} custom inputs their grammar refuses; "
               f"{c['stream_errors']} stream errors; {c['echo_mismatch']} echo "
               f"mismatches; calls stopped by the plugin "
               f"{fuzz.extra.get('plugin_stopped_calls', 0):.0f}; {fuzz.extra.get('seconds')} s")
    return _row("fuzz (both endpoints, unary + stream)", c["requests"], c["2xx"], c["4xx"],
                c["5xx"], c["no_answer"], c["violations_leaked"], len(fuzz.problems), details)


def _load_row(load: Figures) -> str:
    c = load.counts
    details = (f"{c['completed']} streams completed; {c['calls_returned']} calls; "
               f"{c['cross_request_mixups']} cross-request mix-ups; {c['echo_mismatch']} echo "
               f"mismatches; {c['invalid_arguments']} off-schema arguments; "
               f"{load.extra.get('seconds')} s")
    return _row(f"load ({load.extra['concurrency']} concurrent streams x {load.extra['rounds']} "
                f"rounds)", c["requests"], c["2xx"], c["4xx"], c["5xx"], c["no_answer"],
                c["violations_leaked"], len(load.problems), details)


def _faults_row(faults: Figures) -> str:
    c = faults.counts
    all_tokens = [n for values in faults.extra.get("tokens_generated", {}).values()
                  for n in values]
    tried = c["stream_tried"] + c["unary_tried"] + c["half_body_tried"]
    aborted = c["stream_aborted"] + c["unary_aborted"] + c["half_body_aborted"]
    details = (f"aborted correctly: {aborted}/{tried} (mid-stream {c['stream_aborted']}/"
               f"{c['stream_tried']}, unary with the client gone after sending "
               f"{c['unary_aborted']}/{c['unary_tried']}, half-sent body "
               f"{c['half_body_aborted']}/{c['half_body_tried']}); tokens generated before the "
               f"abort, of a {faults.extra['budget_tokens']}-token budget: median "
               f"{_median(all_tokens)}, max {max(all_tokens, default=0)}; server answers "
               f"afterwards: {faults.extra['answers_after']}; {faults.extra.get('seconds')} s")
    return _row("client disconnects", tried, "-", "-", "-", "-", "-", len(faults.problems), details)


def table(fuzz: Figures | None, load: Figures | None, faults: Figures | None) -> str:
    """The fuzz, load and client-fault figures; then the known bugs hit and the RSS by process."""
    rows = [("| part | requests tried | 2xx | 4xx | 5xx | no answer (hang) | violations leaked | "
             "problems | details |"), "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    if fuzz:
        rows.append(_fuzz_row(fuzz))
    if load:
        rows.append(_load_row(load))
    if faults:
        rows.append(_faults_row(faults))
    if fuzz and fuzz.extra.get("known_bugs"):
        rows.append("")
        rows += [f"known bug `{bug}` ({fuzz.counts[f'known_bug:{bug}']} requests): {where}"
                 for bug, where in fuzz.extra["known_bugs"].items()]
    if load and load.extra.get("rss_mib_per_round"):
        rows += ["", ("| server process (RSS MiB) | after round 1 (warm-up) | after the last round "
                      "| growth |"), "|---|---:|---:|---:|"]
        for key, values in load.extra["rss_mib_per_round"].items():
            rows.append(f"| {key} | {values[0]} | {values[-1]} | "
                        f"{load.extra['rss_growth_mib'][key]:+} |")
    return "\n".join(rows)


def _outage_row(outage: Figures) -> str:
    c = outage.counts
    kinds = [k.split(":")[0] for k in c if k.endswith(":tried")]
    per = ", ".join(f"{k} {c[k + ':refused']}/{c[k + ':tried']}" for k in kinds)
    details = (f"refused as store-down (503 `grant_store_unavailable`, or `response.failed` with "
               f"it in a started stream) {c['outage_refused_store_down']} ({per}); other 5xx "
               f"{c['outage_5xx_other']}; gated turns without any call "
               f"{c['outage_gated_without_call']}; turns without a gated tool answered 200: "
               f"{c['outage_free_ok']}; recovered after the outage: {c['outage_recovered']}/"
               f"{c['outages']}")
    return _row(f"grant store unavailable ({', '.join(kinds)})", c["outage_tried"],
                c["outage_4xx"], c["outage_5xx"] - c["outage_5xx_other"], c["outage_5xx_other"],
                c["gated_leaked"], "-", "-", len(outage.problems), details)


def _kill_row(kill: Figures) -> str:
    c = kill.counts
    details = (f"found after restart {c['grants_found_after_restart']}, usable "
               f"{c['grants_usable_after_restart']}; answers in flight at the kill "
               f"{c['kill_answers_in_flight_at_kill']} (grants stored but never acknowledged: "
               f"{c['grants_found_not_acknowledged']}); integrity/foreign-key check failures "
               f"{c['store_integrity_failures']}; {kill.extra.get('kill_seconds')} s")
    return _row(f"API server process group SIGKILLed x {c['kills']}, restarted on the same "
                f"SQLite store", c["kill_requests"], "-", "-", "-", "-", c["grants_acknowledged"],
                c["grants_lost"], len(kill.problems), details)


def approvals_table(outage: Figures | None, kill: Figures | None) -> str:
    """The grant-store outage and SIGKILL figures."""
    rows = [("| fault | requests tried | 4xx | 503 `grant_store_unavailable` (the fail-closed "
             "answer) | other 5xx | gated calls leaked while the store was down | "
             "grants acknowledged | grants lost after kill | problems | details |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    if outage:
        rows.append(_outage_row(outage))
    if kill:
        rows.append(_kill_row(kill))
    return "\n".join(rows)
