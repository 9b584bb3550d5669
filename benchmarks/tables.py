"""Summary rows of the benchmark results, for the tables the docs generate.

Each results file under ``benchmarks/results/`` (and its subfolders) gets one small row
builder that reads the file's JSON and states its headline figures; :func:`rows_of` adds
the command that reproduces the file (from its ``benchmark`` name, ``quick`` flag, mode
and folder) and the date it was measured. Standard library only: the docs build imports
this without torch.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import churn, goodput, islands, sparse
from benchmarks._formats import bpb, kb, markdown_table, mb, pct, run_mode, sci, size, span, times
from benchmarks._robustness_checks_report import table_row as checks_row
from benchmarks._scale_tables import scale_load_table, scale_row, scale_simulated_table
from benchmarks._sparse_tables import allreduce_codecs_row, sparse_row

__all__ = [
    "RESULTS",
    "ROW_BUILDERS",
    "Row",
    "command_of",
    "markdown_table",
    "results_files",
    "rows",
    "rows_of",
    "scale_load_table",
    "scale_simulated_table",
]

RESULTS = Path(__file__).resolve().parent / "results"
"""Where ``python -m benchmarks`` writes its results by default."""

_DEFAULT_OUT = "benchmarks/results"


@dataclass(frozen=True)
class Row:
    """One line of the benchmark summary.

    Attributes:
        what: what was measured, and how.
        result: the headline figures.
        target: what the figures are held to ("" when nothing is).
        command: the command that writes the results file again.
        date: when the file was measured (ISO 8601, UTC).
    """

    what: str
    result: str
    target: str
    command: str
    date: str


_Cells = tuple[str, str, str]  # what, result, target


# ---- one builder per results file ---------------------------------------------------------


def _codec(d: dict[str, Any]) -> list[_Cells]:
    r = d["results"]
    names = [n for n in ("fp16", "bf16", "int8", "int4") if n in r]
    rmse = ", ".join(f"{n} {sci(r[n]['rel_rmse'])}" for n in names)
    ratio = ", ".join(times(r[n]["compression_ratio"]) for n in names)
    what = f"codecs on {d['numel'] / 1e6:g}M normal floats, block {d['block_size']}"
    return [(what, f"relative RMSE {rmse}; compression {ratio}", "")]


def _stragglers(d: dict[str, Any]) -> list[_Cells]:
    m = d["methods"]
    sec, steps, ddp = m["atoll_seconds"], m["atoll_steps"], m["ddp"]
    slow = ", ".join(f"{s:g}" for s in d["slowdowns"])
    result = (
        f"Atoll `seconds` **{pct(sec['utilization'])}** (fast nodes idle "
        f"{span(sec['fast_idle_share'], lambda x: f'{x * 100:.1f}')} %), Atoll `steps` "
        f"{pct(steps['utilization'])}, PyTorch DDP (gloo) {pct(ddp['utilization'])}; "
        f"weighted by speed: {pct(sec['compute_utilization'])}, "
        f"{pct(steps['compute_utilization'])}, {pct(ddp['compute_utilization'])} "
        f"(DDP's ideal: {pct(ddp['expected_compute_utilization'])})"
    )
    what = f"stragglers: utilization at slowdowns {slow} (useful / available time)"
    return [(what, result, "≥ 95 %")]


def _allreduce_size(d: dict[str, Any], n: str) -> str:
    r, q = d["results"], d["ratios"]

    def s(method: str) -> str:
        return f"{r[method][n]['median_s']:.3f} s"

    parts = [f"gloo {s('gloo')}", f"hivemind step {s('hivemind')}"]
    parts.append(f"Atoll over p2pd {s('atoll')} (speed **{q['atoll_vs_hivemind'][n]:.2f}**)")
    if "atoll_tcp" in r:
        parts.append(
            f"over TCP {s('atoll_tcp')} (**{q['atoll_tcp_vs_hivemind'][n]:.2f}**, "
            f"{1 / q['atoll_tcp_vs_gloo'][n]:.2f}× gloo's time)"
        )
    if "atoll_tls" in r:
        parts.append(
            f"over TLS {s('atoll_tls')} ({q['atoll_tls_vs_hivemind'][n]:.2f}; "
            f"{q['tls_vs_tcp'][n]:.2f}× TCP's time)"
        )
    if "atoll_verified" in r:
        parts.append(f"with verification {s('atoll_verified')} ({q['verified_vs_atoll'][n]:.2f}×)")
    if "atoll_streamed" in r:
        parts.append(
            f"reducing while parts arrive and streaming results back {s('atoll_streamed')} "
            f"({q['streamed_vs_atoll'][n]:.2f}×)"
        )
    rss = r["atoll"][n]["rss_step_extra_mb"]
    fragment = r["atoll"][n]["fragment_mb"]
    others = ", ".join(
        f"{label} {statistics.median(r[m][n]['rss_step_extra_mb']):.0f}"
        for m, label in (("atoll_tls", "TLS"), ("atoll_streamed", "streamed"))
        if m in r
    )
    parts.append(
        f"peak memory a step adds to a peer {rss[0]:.0f} → {rss[-1]:.0f} MB over the "
        f"repeats ({statistics.median(rss) / fragment:.2f}× the {fragment:.0f} MB fragment"
        + (f"; median {others} MB)" if others else ")")
    )
    return f"{size(int(n))}: " + ", ".join(parts)


def _allreduce(d: dict[str, Any]) -> list[_Cells]:
    sizes = sorted(d["results"]["atoll"], key=int)
    mode = "quick" if d["quick"] else "full"
    what = (
        f"all-reduce of {' and '.join(size(int(n)) for n in sizes)} float32, {d['peers']} "
        f"processes, {mode} mode ({d['repeats']} repeats, median; every part and result "
        "signed, codec none)"
    )
    result = "; ".join(_allreduce_size(d, n) for n in sizes)
    rows = [(what, result, "≥ 1.5 over p2pd; ≥ 3 and within 3× of gloo over TCP")]
    if "topk_vs_int8_p2pd" in d.get("ratios", {}):
        rows.append(allreduce_codecs_row(d, mode))
    return rows


def _verification(d: dict[str, Any]) -> list[_Cells]:
    parts, detail = [], ""
    for r in d["results"].values():
        label = "uncompressed" if r["codec"] == "none" else f"for {r['codec']} parts"
        off, on = r["off"]["median_s"] * 1e3, r["on"]["median_s"] * 1e3
        parts.append(f"**{r['ratio']:.3f}×** {label} ({off:.1f} → {on:.1f} ms)")
        if not detail:
            per = r["on"]["per_member_per_round_s"]
            detail = (
                f"; per member per round ({r['codec']}): screening {per['screen_s'] * 1e3:.1f} ms, "
                f"aggregation {per['aggregate_s'] * 1e3:.1f} ms, SQLite "
                f"{per['sqlite_s'] * 1e3:.2f} ms, check of the owners' results "
                f"{per['check_reduced_s'] * 1e3:.1f} ms"
            )
    n = next(iter(d["results"].values()))["n"]
    what = (
        f"verification overhead, {d['members']} members each in its own process, "
        f"{size(n)} float32, {d['policy']['aggregator'].replace('_', ' ')} + screening + audit"
    )
    result = (
        f"median round time with the whole layer on against plain mean, {d['repeats']} "
        f"alternating rounds of each: " + " and ".join(parts) + detail
    )
    return [(what, result, "< 10 %")]


_ROBUST_NAMES = {"mean-unscreened": "mean unscreened", "trimmed_mean": "trimmed mean"}


def _robustness(d: dict[str, Any]) -> list[_Cells]:
    by_mode: dict[str, list[str]] = {}
    flagged: dict[str, int] = {}
    for c in d["cells"]:
        name = _ROBUST_NAMES.get(c["aggregator"], c["aggregator"].replace("_", " "))
        if c.get("codec", "int8") != "int8":
            name += f" ({c['codec']})"
        ratio = c["ratio_to_clean"]
        shown = f"{ratio:.0f}×" if ratio >= 10 else f"{ratio:.2f}"
        by_mode.setdefault(c["mode"], []).append(f"{name} {bpb(c['val_bpb_end'])} ({shown})")
        if c["screening"]:
            flagged[c["mode"]] = min(flagged.get(c["mode"], 99), c["attacker_flagged_by"])
    honest = d["cells"][0]["honest_nodes"]
    cells = "; ".join(f"`{m}`: " + ", ".join(v) for m, v in by_mode.items())
    by_all = [f"`{m}`" for m, k in flagged.items() if k == honest]
    by_none = [f"`{m}`" for m, k in flagged.items() if k == 0]
    clean = " / ".join(bpb(c["val_bpb_end"]) for c in next(iter(d["clean"].values())).values())
    result = (
        f"{cells}; with screening the attacker is flagged by all {honest} honest nodes for "
        f"{', '.join(by_all) or 'no mode'}, by none for {', '.join(by_none) or 'no mode'}; "
        f"honest peers flagged in clean runs: **{d['clean_honest_flagged']}**; clean runs end "
        f"at {clean}"
    )
    nodes, bad = d["cells"][0]["nodes"], d["cells"][0]["byzantine"]
    what = (
        f"robustness, {bad} of {nodes} nodes faulty, {d['rounds']} wall-clock rounds, control "
        "channel and commit phase on (bits/byte, ratio to the clean run with the same aggregator)"
    )
    return [(what, result, "within 5 %, 0 flagged")]


_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "muon": "Muon", "soap": "SOAP", "sgd": "SGD"}


def _convergence_entry(d: dict[str, Any], e: dict[str, Any], best: bool) -> str:
    digits = 2 if d.get("mode") == "long" else 1
    s, gap = e["setting"], e["gap_to_ddp_percent"]
    name = (
        "`configs/islands.toml`"
        if s["islands"]
        else f"{_OPTIMIZERS.get(s['optimizer'], s['optimizer'])} H={s['inner_steps']}"
    )
    figure = f"{gap['mean']:+.{digits}f} ± {gap['std']:.{digits}f} %"
    if best:
        figure = (
            f"(lr {s['lr']:g}, {s['outer']}) {e['val_bpb_end']['mean']:.3f} ± "
            f"{e['val_bpb_end']['std']:.3f}, **{figure}**, as good as DDP at step "
            f"{e['ddp_equivalent_steps']['mean']:,.0f} of {d['total_steps']:,}"
        )
    return (
        f"{name} {figure} (worth {e['worth_ddp_workers']:.1f} DDP workers, "
        f"{e['bytes_ratio_ddp_over_atoll']:.0f}× fewer bytes)"
    )


def _codec_spread(d: dict[str, Any]) -> float | None:
    """The largest gap, in %, between a codec's final bits per byte and uncompressed."""
    by_setting: dict[tuple[str, int], dict[str, float]] = {}
    for e in d["entries"]:
        s = e["setting"]
        if s["method"] == "atoll" and not s["islands"]:
            key = (s["optimizer"], s["inner_steps"])
            by_setting.setdefault(key, {})[s["codec"]] = e["val_bpb_end"]["mean"]
    spread = [
        abs(v - codecs["none"]) / codecs["none"] * 100
        for codecs in by_setting.values()
        if "none" in codecs
        for v in codecs.values()
    ]
    return max(spread) if spread else None


def _convergence(d: dict[str, Any]) -> list[_Cells]:
    if d.get("mode") == "sparse":
        return sparse_row(d)
    ddp = d["ddp"]
    opt, lr = ddp["label"].split()[1], ddp["label"].split()[-1]
    parts = [
        f"tuned DDP ({_OPTIMIZERS.get(opt, opt)}, lr {lr}) **{ddp['val_bpb_end']['mean']:.3f} ± "
        f"{ddp['val_bpb_end']['std']:.3f}**"
    ]
    shown = [
        e
        for e in d["entries"]
        if e["setting"]["method"] == "atoll"
        and (e["setting"]["codec"] == "int8" or e["setting"]["islands"])
    ]
    best = min(shown, key=lambda e: e["gap_to_ddp_percent"]["mean"], default=None)
    parts += [_convergence_entry(d, e, e is best) for e in shown]
    spread = _codec_spread(d)
    if spread is not None:
        parts.append(f"int8 and int4 within {spread:.2f} % of uncompressed")
    # the untuned comparison: DDP with AdamW at its best lr
    adamw = [c for c in d.get("sweep", []) if c["label"].startswith("DDP adamw")]
    if adamw:
        c = min(adamw, key=lambda c: c["val_bpb_end_seed0"])
        parts.append(
            f"DDP with AdamW at its best lr ({c['setting']['lr']:g}): "
            f"{c['val_bpb_end_seed0']:.3f} at seed 0"
        )
    if not any(e.get("meets_target") for e in d["entries"]):
        parts.append("no run meets the target")
    what = (
        f"convergence at equal tokens ({d['mode']} mode), {d['workers']} workers, "
        f"{d['total_steps']:,} steps each, {len(d['seeds'])} seeds (mean ± sd), "
        f"{d['eval_batches']} held-out batches; Atoll int8, gap to tuned DDP"
    )
    target = (
        f"within {d['target']['max_gap_percent']:g} % of tuned DDP with ≥ "
        f"{d['target']['min_bytes_ratio']:,.0f}× fewer bytes"
    )
    return [(what, "; ".join(parts), target)]


def _wan(d: dict[str, Any]) -> list[_Cells]:
    parts = []
    for link in d["links"]:
        a, p = link["atoll"], link["ddp"]
        parts.append(
            f"{link['link']}: Atoll **{pct(a['utilization'])}**, DDP {pct(p['utilization'])} "
            f"(DDP step {p['step_seconds']:.2f} s)"
        )
    netns = d.get("mode") == "netns"
    key = "wire_bytes_sent_per_worker" if netns else "bytes_sent_per_worker"
    atoll = [link["atoll"][key] for link in d["links"]]
    ddp = [link["ddp"][key] for link in d["links"]]
    reduce = [link["atoll"]["bytes_sent_per_worker"] for link in d["links"]]
    of_it = f" ({span(reduce, lambda x: mb(x, 2))} of it all-reduce)" if netns else ""
    bytes_text = (
        f"bytes {'on the wire (eth0 counters) ' if netns else ''}per worker: Atoll "
        f"{span(atoll, mb)}{of_it}, DDP {span(ddp, lambda x: f'{x / 1e6:.0f}')} MB"
    )
    measured = [link["atoll"]["round_seconds"] for link in d["links"]]
    rounds = statistics.mean(r for r in measured if r is not None) if any(measured) else 0.0
    where = "kernel-shaped links (`--netns`)" if netns else "long links emulated on loopback"
    what = (
        f"{where}, {d['workers']} workers, {d['rounds']} rounds of {rounds:.0f} s each "
        "(utilization = share of wall time computing)"
    )
    result = "; ".join([*parts, bytes_text])
    return [(what, result, "Atoll's utilization independent of the link")]


def _mixing(d: dict[str, Any]) -> list[_Cells]:
    sizes = [str(n) for n in d["sizes"] if str(n) in d["results"]]
    res = [d["results"][n] for n in sizes]

    def joined(f: Callable[[dict[str, Any]], str]) -> str:
        return " / ".join(f(r) for r in res)

    def per_round(r: dict[str, Any]) -> str:
        der = r["derived"]
        return kb(der["butterfly_full_mix_bytes"] / der["rounds_to_mix_butterfly"])

    incomplete = [n for n, r in zip(sizes, res) if not r["allreduce"]["all_syncs_complete"]]
    result = (
        f"bytes one node sends per round: butterfly **{joined(per_round)}**, so a full mix "
        f"({joined(lambda r: str(r['derived']['rounds_to_mix_butterfly']))} rounds) costs "
        f"{joined(lambda r: kb(r['derived']['butterfly_full_mix_bytes']))}; all-to-all "
        f"(computed) {joined(lambda r: kb(r['derived']['all_to_all_full_mix_bytes']))}; "
        f"swarm-wide all-reduce {joined(lambda r: kb(r['derived']['allreduce_full_mix_bytes']))}"
        " per round; round time butterfly "
        f"{joined(lambda r: format(r['butterfly']['round_seconds'], '.2g'))} s, swarm-wide "
        f"{joined(lambda r: format(r['allreduce']['round_seconds'], '.2g'))} s"
        + (
            f" (some swarm-wide syncs incomplete at n = {', '.join(incomplete)})"
            if incomplete
            else ""
        )
        + f"; final bits/byte {joined(lambda r: format(r['butterfly']['val_bpb_end'], '.2f'))} "
        f"against {joined(lambda r: format(r['allreduce']['val_bpb_end'], '.2f'))}"
    )
    c = d["config"]
    what = (
        f"butterfly mixing against swarm size: {', '.join(sizes)} real nodes in groups of "
        f"{c['butterfly_group_size']} ({c['codec']} parts + {c['mix_codec']} global copies) "
        f"against one swarm-wide group, {d['rounds']} rounds of {c['inner_steps']} steps"
    )
    return [(what, result, "per-node traffic log n against n")]


def _models(d: dict[str, Any]) -> list[_Cells]:
    t, m, c = d["throughput"], d["memory"], d["convergence"]
    mode = "quick" if d["quick"] else "full"
    tiny = next((p for p in m["presets"] if p["preset"] == t["preset"]), None)
    size = f", {tiny['params'] / 1e6:.1f} M parameters" if tiny else ""
    bare = [statistics.mean(pair) for pair in t["bare_tokens_per_second"]]
    rows: list[_Cells] = [
        (
            f"real models ({t['preset']}{size} with a {d['corpus']['vocab_size']:,}-token BPE; "
            f"{mode} mode): tokens/s of two Atoll nodes side by side ({t['round_seconds']:.0f}-s "
            f"wall-clock rounds) against two bare `transformers` loops, "
            f"{len(t['pair_ratios'])} pairs one after the other",
            f"median over all runs **{t['ratio']:.3f}**; per pair "
            f"{', '.join(f'{r:.2f}' for r in t['pair_ratios'])} (median "
            f"**{t['pair_ratio_median']:.3f}**; the bare loop alone moved from {min(bare):,.0f} "
            f"to {max(bare):,.0f} tokens/s between pairs); time outside inner steps "
            f"{pct(t['outside_steps_share'])}; p2pd, DHT and sidecar "
            f"{pct(t['helper_cores_share'])} of a core per node; one node with no peer at the "
            f"same time as one bare loop **{t['side_by_side']['ratio']:.3f}**",
            f"≥ {t['goal']:g}",
        )
    ]
    each = " / ".join(f"{p['beyond_per_param']:.1f}" for p in m["presets"])
    big = max(m["presets"], key=lambda p: p["params"])
    not_run = "; ".join(f"{k}: not run ({v})" for k, v in m.get("not_run", {}).items())
    slope = m["beyond_bytes_per_param"]  # None with fewer than two presets measured
    rows.append(
        (
            "memory of a running node beyond a bare loop of the same model and optimizer (peak "
            f"RSS), slope over {', '.join(p['preset'] for p in m['presets'])}",
            (f"**{slope:.1f} bytes per parameter**" if slope is not None else "no slope")
            + f" ({each} each; "
            f"{big['preset']}: {big['node_peak_rss_bytes'] / 1e9:.2f} GB against "
            f"{big['bare_peak_rss_bytes'] / 1e9:.2f} GB)"
            + (f", {m['fixed_bytes'] / 1e6:.0f} MB fixed" if slope is not None else "")
            + (f"; {not_run}" if not_run else ""),
            f"≤ {m['goal_bytes_per_param']:g}",
        )
    )
    entries = c["entries"]
    gaps = [e["gap_percent"] for e in entries]
    spread = f" ± {statistics.stdev(gaps):.1f}" if len(gaps) > 1 else ""
    sent = [b for e in entries for b in e["atoll"]["bytes_sent_per_node"]]
    agree = all(e["atoll"]["params_agree"] for e in entries)
    rows.append(
        (
            f"{c['nodes']} {t['preset']} nodes (H = {c['inner_steps']}, {c['rounds']} rounds) "
            f"against DDP of {c['nodes']} ranks at equal tokens on BPE shards, {len(entries)} seeds",
            f"bits/byte {span([e['atoll']['val_bpb_end'] for e in entries], lambda x: f'{x:.2f}')} "
            f"against DDP's {span([e['ddp']['val_bpb_end'] for e in entries], lambda x: f'{x:.2f}')}"
            f": gap **{c['gap_percent_mean']:+.1f}{spread} %**; {span(sent, lambda x: mb(x, 0))} "
            f"sent per node; global parameters {'agreed' if agree else 'did not agree'} bitwise "
            "in every run",
            "",
        )
    )
    if "skipped" in d.get("cuda", {}):
        rows.append(("the same on a CUDA device", f"not run: {d['cuda']['skipped']}", ""))
    return rows


def _partitions(d: dict[str, Any]) -> list[_Cells]:
    runs = d["runs"]
    alone = [r for r in runs if r.get("alone_syncs")]
    nodes = len(runs[0]["exit_codes"]) if runs else 0
    mode = "quick" if d["quick"] else "full"
    result = (
        f"**{d['passed']} of {d['of']} runs pass**: in each the stable nodes agreed bitwise in "
        "every round, and the flapping node agreed in every round that began 2 rounds after its "
        "link's return and ended in the full group"
    )
    if alone:
        syncs = sum(r["alone_syncs"] for r in alone)
        result += (
            f"; {syncs} sync(s) averaged alone in {len(alone)} run(s) (logged at WARN, taken "
            "back at the round's end)"
        )
    flaps = runs[0]["flaps"] if runs else 0
    what = (
        f"a flapping link: {nodes} nodes on {nodes} network-namespace hosts, one host's link cut "
        f"{flaps} times at random moments, {mode} mode ({d['of']} runs)"
    )
    return [(what, result, "every run passes")]


def _sites(d: dict[str, Any]) -> list[_Cells]:
    s, n = d["setups"]["sites"], d["setups"]["nodes"]
    agree = "agree" if s["params_agree"] and n["params_agree"] else "differ"
    ranks = ", ranks of each site agree every round" if s["ranks_agree"] else ""
    result = (
        f"bytes sent to the swarm per round: sites **{kb(s['slow_link_bytes_per_round'])}**, "
        f"nodes {kb(n['slow_link_bytes_per_round'])} (**{d['bytes_ratio']:.2f}×**); final "
        f"bits/byte {s['val_bpb_end']:.3f} against {n['val_bpb_end']:.3f}; global parameters "
        f"{agree}{ranks}"
    )
    procs = s["nodes"] * s["procs_per_node"]
    what = (
        f"sites: {s['nodes']} sites × {s['procs_per_node']} ranks against {n['nodes']} "
        f"single-process nodes, same {procs} processes and tokens per round, {d['rounds']} rounds"
    )
    return [(what, result, "about half the bytes")]


def _join(d: dict[str, Any]) -> list[_Cells]:
    mode = run_mode(d)
    cells = []
    for name, r in d["rows"].items():
        first = r["first_exchange_s_median"]
        result = f"**{r['succeeded']} of {r['joins']} joins** exchanged with the swarm"
        if first is not None:
            result += (
                f"; seconds from launch to the first exchange: median **{first:.1f}**, "
                f"max {r['first_exchange_s_max']:.1f}"
            )
        what = (
            f"joining by run address ({name}): volunteers one after another with "
            f"`atoll run --join`, {mode} mode"
        )
        cells.append((what, result, "every join succeeds, within seconds"))
    return cells


def _relay(d: dict[str, Any]) -> list[_Cells]:
    rows, what = d["rows"], "owning parts through a relay (network lab)"
    if set(rows) != {"direct", "relay"}:
        why = "; ".join(sorted(set(d.get("rows_not_run", {}).values()))) or "a row failed"
        return [(what, f"not run: {why}", "parts flow through the relay")]
    direct, relay = rows["direct"]["summary"], rows["relay"]["summary"]
    result = (
        f"volunteers behind NAT own parts from round **{relay['volunteers_own_from_round']}** "
        f"(public: {direct['volunteers_own_from_round']}); from round 10 the relay's link "
        f"moved **{d['relay_link_ratio']}×** what it did with public volunteers "
        f"({d['relayed_bytes'] / 1e6:+.1f} MB); median exchange "
        f"{relay['exchange_s_median']} s against {direct['exchange_s_median']} s"
    )
    what = (
        f"owning parts through a relay: two volunteers behind NATs of their own against "
        f"public ones, {d['rounds']} rounds of 20 s (network lab), {run_mode(d)} mode"
    )
    return [(what, result, "parts flow through the relay")]


ROW_BUILDERS: dict[str, Callable[[dict[str, Any]], list[_Cells]]] = {
    "allreduce": _allreduce,
    "churn": churn.table_row,
    "codec": _codec,
    "convergence": _convergence,
    "goodput": goodput.table_row,
    "islands": islands.table_row,
    "join": _join,
    "relay": _relay,
    "mixing": _mixing,
    "models": _models,
    "partitions": _partitions,
    "robustness": lambda d: checks_row(d) if d.get("mode") == "checks" else _robustness(d),
    "scale": scale_row,
    "sites": _sites,
    "sparse": sparse.table_row,
    "stragglers": _stragglers,
    "verification": _verification,
    "wan": _wan,
}
"""Benchmark name (a results file's ``benchmark`` field) -> its row builder."""


def results_files(root: Path = RESULTS) -> list[Path]:
    """Every results file under ``root`` and its subfolders that names its benchmark."""
    found = sorted([*root.glob("*.json"), *root.glob("*/*.json")])
    return [p for p in found if "benchmark" in json.loads(p.read_text())]


def command_of(path: Path, data: dict[str, Any], root: Path = RESULTS) -> str:
    """The command that writes ``path`` again, from its name, flags, mode and folder."""
    command = f"python -m benchmarks {data['benchmark']}"
    if data.get("quick"):
        command += " --quick"
    if data.get("smoke"):
        command += " --smoke"
    mode = data.get("mode")
    if mode in ("long", "netns", "sparse", "checks"):
        command += f" --{mode}"
    folder = path.parent.relative_to(root)
    if folder != Path("."):
        command += f" --out {_DEFAULT_OUT}/{folder.as_posix()}"
    return command


def rows_of(path: Path, root: Path = RESULTS) -> list[Row]:
    """The summary rows of one results file.

    Raises:
        KeyError: the file names no benchmark with a row builder.
    """
    data = json.loads(path.read_text())
    build = ROW_BUILDERS[data["benchmark"]]
    command, date = command_of(path, data, root), data.get("date", "")
    return [Row(what, result, target, command, date) for what, result, target in build(data)]


def rows(root: Path = RESULTS) -> list[Row]:
    """The summary rows of every results file under ``root``, file by file."""
    return [row for path in results_files(root) for row in rows_of(path, root)]
