"""The all-reduce benchmark's report: its figure, the ratios of its medians, its notes.

:mod:`benchmarks.allreduce` measures; this turns its ``results[method][size]`` records
into ``allreduce.png`` (codec ``none`` methods on the left, the int8 and topk rows on
the right), the ``ratios`` of its JSON, and the notes that say what each row is.
"""

from __future__ import annotations

import pathlib
from typing import Any

from benchmarks import _allreduce_codecs as codec_rows
from benchmarks._common import figure

__all__ = ["NOTES", "plot", "ratios"]


def _ratio(slow: dict, fast: dict, key: str = "median_s") -> float | None:
    if slow.get(key) and fast.get("median_s"):
        return slow[key] / fast["median_s"]
    return None


_BARS = [
    ("gloo", "gloo (torch.distributed)", "median_s", "tab:gray"),
    ("atoll", "Atoll (codec none, signed)", "median_s", "tab:blue"),
    ("atoll_streamed", "Atoll, reducing while parts arrive", "median_s", "tab:gray"),
    ("atoll_verified", "Atoll + screening, trimmed mean, audit", "median_s", "tab:purple"),
    ("atoll_tcp", "Atoll, direct TCP data plane", "median_s", "tab:cyan"),
    ("atoll_tls", "Atoll, direct plane with TLS", "median_s", "tab:green"),
    ("hivemind", "hivemind all-reduce part", "allreduce_median_s", "tab:olive"),
    ("hivemind", "hivemind step (with matchmaking)", "median_s", "tab:orange"),
]


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.0f} kB"


def _bars(ax: Any, results: dict, bars: list[tuple[str, str, str, str]], title: str) -> None:
    """One bar per method and size; a codec row's bar also says its bytes sent per peer."""
    sizes = sorted({int(n) for method, *_ in bars for n in results[method]})
    width = 0.8 / len(bars)
    for k, (method, label, key, color) in enumerate(bars):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(sizes))]
        records = [results[method].get(str(n), {}) for n in sizes]
        ys = [r.get(key) or 0.0 for r in records]
        ax.bar(xs, ys, width, label=label, color=color)
        for x, y, r in zip(xs, ys, records):
            text = f"{y:.2f}s" if y else "n/a"
            if y and method in codec_rows.METHODS and r.get("bytes_sent_per_peer"):
                text += "\n" + _size(r["bytes_sent_per_peer"])
            ax.annotate(text, (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(sizes)), [f"{n / 1e6:g}M float32" for n in sizes])
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)  # room for the labels above the tallest bar
    ax.grid(axis="y", alpha=0.3)
    # below the axes, clear of the bars' labels
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)


def plot(results: dict, peers: int, path: pathlib.Path) -> None:
    """Writes the figure of ``results`` (``results[method][size]``) to ``path``."""
    with figure(path, 1, 2, figsize=(13, 5.6), width_ratios=(3, 2)) as (fig, (left, right)):
        _bars(left, results, _BARS, "codec none")
        codec_bars = [(m, label, "median_s", color) for m, label, color in codec_rows.PLOT_BARS]
        _bars(right, results, codec_bars, "encode + exchange + decode (bytes sent per peer)")
        left.set_ylabel("median seconds per all-reduce (slowest peer)")
        fig.suptitle(f"{peers}-peer average on 127.0.0.1, one process per peer")


def ratios(results: dict) -> dict:
    """Speed ratios of the medians (other / Atoll's: above 1, Atoll is faster), and
    topk's time and bytes over int8's (:func:`benchmarks._allreduce_codecs.ratios`)."""
    atoll, tcp = results["atoll"], results["atoll_tcp"]
    return {
        "atoll_vs_hivemind": {k: _ratio(results["hivemind"][k], a) for k, a in atoll.items()},
        "atoll_vs_hivemind_allreduce_only": {
            k: _ratio(results["hivemind"][k], a, "allreduce_median_s") for k, a in atoll.items()
        },
        "atoll_vs_gloo": {k: _ratio(results["gloo"][k], a) for k, a in atoll.items()},
        "verified_vs_atoll": {k: _ratio(results["atoll_verified"][k], a) for k, a in atoll.items()},
        "streamed_vs_atoll": {k: _ratio(results["atoll_streamed"][k], a) for k, a in atoll.items()},
        "atoll_tcp_vs_hivemind": {k: _ratio(results["hivemind"][k], a) for k, a in tcp.items()},
        "atoll_tcp_vs_gloo": {k: _ratio(results["gloo"][k], a) for k, a in tcp.items()},
        "atoll_tls_vs_hivemind": {
            k: _ratio(results["hivemind"][k], a) for k, a in results["atoll_tls"].items()
        },
        "tls_vs_tcp": {k: _ratio(a, tcp[k]) for k, a in results["atoll_tls"].items()},
        **codec_rows.ratios(results),
    }


_NONE_NOTES = {
    "timing": "one untimed warm-up, then each repeat released to all peers at one "
    "instant; a repeat's time is the slowest peer's; ratios are other/atoll, >1 means "
    "Atoll is faster",
    "atoll": "AllReduceService.run with the group given (no matchmaking), codec none, "
    "every part and result Ed25519-signed and checked",
    "atoll_streamed": "the same as atoll with each owner reducing block by block "
    "while the parts arrive (stream_reduce = true); streamed_vs_atoll < 1 is what "
    "that saves, > 1 what it costs; streamed_share: the share of an owner's part "
    "reduced before its last part was in; results_streamed_share: the share of "
    "results members took as they were reduced, bound by a signed trailer; "
    "reduce_times: an owner's time from its last part in to its signed result",
    "atoll_verified": "the same with a node's verification layer as reducer and "
    "judge: screening, trimmed mean, reputation and a SQLite audit log per peer; "
    "verified_vs_atoll > 1 is its overhead",
    "atoll_tcp": "the same as atoll over the direct TCP data plane "
    "(transport data_plane = tcp: kept connections opened with a signed handshake, "
    "not encrypted) instead of p2pd",
    "atoll_tls": "the same over the direct plane encrypted with TLS 1.3 (transport "
    "data_plane = tls: a self-signed certificate bound to the signed handshake); "
    "tls_vs_tcp > 1 is the cost of encryption",
    "memory": "rss_step_extra_mb: the peak resident memory of a peer's process during "
    "a repeat minus its memory before the first one (its own vector, the output it "
    "averages into and the reference mean are allocated before); rss_growth_mb: its "
    "memory after the last repeat minus after the first",
    "hivemind": "times are DecentralizedAverager.step wall time, which includes "
    "matchmaking through the DHT; matchmaking_* and allreduce_* split it at the "
    "AWAITING_TRIGGER stage (step(require_trigger=True)); NoCompression",
    "gloo": "torch.distributed all_reduce (sum) plus division by the peer count",
}


NOTES = {**_NONE_NOTES, **codec_rows.NOTES}
"""What each row and field of ``allreduce.json`` is."""
