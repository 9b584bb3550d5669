"""Verification overhead: what screening, robust aggregation and the audit log cost a round.

Four real :class:`~protocol.p2p.transport.Transport` instances (each with its own p2pd and
DHT) run in this one process on 127.0.0.1 and all-reduce a float32 vector together,
the group given, for codecs ``int8`` and ``none``:

* **verification on**: every service's reducer and judge is a
  :class:`node.verifier.Verifier` with ``TrustPolicy(aggregator="trimmed_mean",
  screening=True)`` writing its audit rows and reputations to a SQLite file, exactly
  as a node does;
* **verification off**: the default token-weighted mean, a judge that accepts everything.

Signatures are part of Atoll's wire format in both cases, so their cost is measured
apart: a micro-benchmark seals and opens one part-sized envelope against plain
``msgpack.packb``/``unpackb`` of the same fields, and the difference, times the
messages one member seals and opens per all-reduce, is reported as a share of the
round. The same four services run both modes, switching reducer and judge between
rounds: one untimed warm-up of each, then 40 repeats of each, off and on in turn (off-on,
then on-off), so that both see the same load on a shared machine. A round's time is
the wall time until all four members are done. Run it with
``python -m benchmarks verification [--quick]``; it writes ``verification.json`` and
``verification.png`` into the output folder.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import pathlib
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import blake3
import torch

from benchmarks._common import machine_info
from node import verifier as verifier_module
from node.verifier import Verifier
from protocol.averaging.allreduce import RPC_NAME, AllReduceService
from protocol.averaging.parts import (
    AllReduceResult,
    AllReduceSettings,
    Contribution,
    Judge,
    Reduction,
    part_bounds,
    weighted_mean_reducer,
)
from protocol.averaging.repair import REPAIR_RPC
from protocol.p2p.transport import Transport, TransportConfig
from protocol.wire import codec as codecs
from protocol.wire.messages import Header, open_envelope, seal
from protocol.wire.partwire import open_part, seal_part
from verification.identity import Identity
from verification.policy import TrustPolicy

__all__ = ["run"]

_MEMBERS = 4
_REPEATS = 40  # single rounds vary by tens of % on a shared host; medians of 40 do not
_CODECS = ("int8", "none")
_RUN_ID = "bench-verification"
# An all-reduce of 10M values by four members sharing two busy cores takes seconds; a
# round that waits this long has lost a message, and is reported, not waited out.
_TIMEOUT = 30.0
_MICRO_REPEATS = 7
_TORCH_THREADS = 1
_SQLITE_CALLS = (
    ("audit", "append_many"),
    ("audit", "append"),
    ("reputation", "record"),
    ("reputation", "standing"),
)


# ---- timing hooks ---------------------------------------------------------------------


class _Clock:
    """Seconds spent in named parts of the protocol, summed over every member."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()  # each transport's loop thread adds to it

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        return timed


class _TimedVerifier(Verifier):
    """A :class:`Verifier` that reports where its time goes (SQLite apart)."""

    def __init__(self, policy: TrustPolicy, db_path: pathlib.Path, me: str, clock: _Clock) -> None:
        super().__init__(policy, db_path, me)
        self.clock = clock
        for owner, method in _SQLITE_CALLS:
            target = getattr(self, owner)
            setattr(target, method, clock.wrap("sqlite_s", getattr(target, method)))

    def reduce(
        self, round_: int, fragment: int, part: int, contributions: Sequence[Contribution]
    ) -> Reduction:
        t0 = time.perf_counter()
        try:
            return super().reduce(round_, fragment, part, contributions)
        finally:
            self.clock.add("reduce_s", time.perf_counter() - t0)

    def check_reduced(self, *args: Any, **kwargs: Any) -> str | None:
        t0 = time.perf_counter()
        try:
            return super().check_reduced(*args, **kwargs)
        finally:
            self.clock.add("check_reduced_s", time.perf_counter() - t0)


# ---- the four transports and their services -------------------------------------------


@contextlib.contextmanager
def _transports(tmp: pathlib.Path) -> Iterator[tuple[list[Transport], list[Identity]]]:
    identities = [Identity.generate() for _ in range(_MEMBERS)]
    transports: list[Transport] = []
    try:
        for i, identity in enumerate(identities):
            identity.save(tmp / f"key{i}")
            config = TransportConfig(
                identity_path=tmp / f"key{i}",
                initial_peers=tuple(transports[0].maddrs) if transports else (),
                request_timeout=_TIMEOUT,
                startup_timeout=_TIMEOUT,
            )
            transports.append(Transport.start(config))
        yield transports, identities
    finally:
        for transport in reversed(transports):
            transport.shutdown()


def _vectors(n: int) -> list[torch.Tensor]:
    # Pseudo-gradients of one model share a direction; independent noise alone would
    # make screening judge a situation that never happens in training.
    gen = torch.Generator().manual_seed(n)
    common = torch.randn(n, generator=gen)
    return [common + 0.5 * torch.randn(n, generator=gen) for _ in range(_MEMBERS)]


def _measure(
    transports: list[Transport],
    identities: list[Identity],
    n: int,
    codec: str,
    rounds: Iterator[int],
    tmp: pathlib.Path,
) -> dict[str, dict[str, Any]]:
    """A warm-up and ``_REPEATS`` timed all-reduces of ``n`` values, off and on in turn.

    The same services run both modes: before each round every service gets the
    mode's reducer and judge. Alternating (off-on, then on-off) exposes both modes
    to the same load on the machine, which drifts over seconds on a shared host.
    """
    settings = AllReduceSettings(run_id=_RUN_ID, codec=codec, timeout=_TIMEOUT)
    clocks = {"off": _Clock(), "on": _Clock()}
    verifiers: list[_TimedVerifier] = []
    services: list[AllReduceService] = []
    hooks = contextlib.ExitStack()
    try:
        # split the verifier's reduce into screening and robust aggregation
        for name in ("screen", "aggregate"):
            timed = clocks["on"].wrap(f"{name}_s", getattr(verifier_module, name))
            hooks.enter_context(mock.patch.object(verifier_module, name, timed))
        plain = clocks["off"].wrap("reduce_s", weighted_mean_reducer)
        for i, (transport, identity) in enumerate(zip(transports, identities)):
            policy = TrustPolicy(aggregator="trimmed_mean", screening=True)
            db = tmp / f"verify-{n}-{codec}-{i}.db"  # fresh: no history from other runs
            verifiers.append(_TimedVerifier(policy, db, identity.peer_id, clocks["on"]))
            service = AllReduceService(transport, identity, settings)
            service.register()
            services.append(service)
        modes = {
            "off": [(plain, Judge()) for _ in services],
            "on": [(v.reduce, v) for v in verifiers],
        }
        group = [identity.peer_id for identity in identities]
        vectors = _vectors(n)
        times: dict[str, list[float]] = {"off": [], "on": []}
        incomplete: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        rejected: dict[str, Counter[str]] = {"off": Counter(), "on": Counter()}
        bytes_sent: dict[str, int] = {}
        for repeat in range(_REPEATS + 1):
            if repeat == 1:
                for clock in clocks.values():
                    clock.seconds.clear()  # the warm-up opened connections and tables
            for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
                for service, (reducer, judge) in zip(services, modes[mode]):
                    service.wire.reducer, service.wire.judge = reducer, judge
                round_ = next(rounds)
                before = _rejected(services)
                seconds, results = _round(services, group, vectors, round_)
                rejected[mode] += _rejected(services) - before
                # kept in the times: a round that lost a part is part of what it cost
                incomplete[mode] += [
                    _incomplete(round_, i, r) for i, r in enumerate(results) if not r.complete
                ]
                bytes_sent[mode] = results[0].bytes_sent
                if repeat:
                    times[mode].append(seconds)
        out = {}
        for mode in ("off", "on"):
            seconds = clocks[mode].seconds
            out[mode] = {
                "times": times[mode],
                "median_s": statistics.median(times[mode]),
                "per_member_per_round_s": {
                    k: v / (_REPEATS * _MEMBERS) for k, v in sorted(seconds.items())
                },
                "rejected": dict(rejected[mode]),
                "incomplete": incomplete[mode],
                "bytes_sent_per_member": bytes_sent[mode],
            }
        return out
    finally:
        hooks.close()
        for service in services:
            service.transport.remove_handler(RPC_NAME)
            service.transport.remove_handler(REPAIR_RPC)
        for verifier in verifiers:
            verifier.close()


def _round(
    services: list[AllReduceService],
    group: list[str],
    vectors: list[torch.Tensor],
    round_: int,
) -> tuple[float, list[AllReduceResult]]:
    """One all-reduce by every member: its wall time until all are done, and the results."""
    for service in services:
        service.current_round = round_  # owners accept only rounds near this one
    t0 = time.perf_counter()
    futures = [
        s.transport.submit(s.run(round_, 0, group, v, 1000)) for s, v in zip(services, vectors)
    ]
    results = [f.result(_TIMEOUT * 3) for f in futures]
    return time.perf_counter() - t0, results


def _rejected(services: list[AllReduceService]) -> Counter[str]:
    return sum((Counter(s.rejected) for s in services), Counter())


def _incomplete(round_: int, member: int, result: AllReduceResult) -> dict[str, Any]:
    return {
        "round": round_,
        "member": member,
        "seconds": result.seconds,
        "fallback_parts": result.fallback_parts,
        "repaired_parts": result.repaired_parts,
        "contributors_per_part": [len(c) for c in result.contributors],
    }


# ---- signatures, measured apart --------------------------------------------------------


def _best(fn: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(_MICRO_REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _signature_cost(n: int, codec: str, identities: list[Identity]) -> dict[str, float]:
    """Seal/open of one part in the wire format parts use (:mod:`protocol.wire.partwire`: a
    signed head binding BLAKE3 chunk hashes, the body raw), next to the msgpack envelope
    parts used before and to the two hashes alone over the same body."""
    me = identities[1]
    lo, hi = part_bounds(n, _MEMBERS, 256)[1]
    enc = codecs.encode(_vectors(n)[1][lo:hi], codec)
    meta = {"group": [i.peer_id for i in identities], "weight": 1000, **enc.meta()}
    header = Header("part", _RUN_ID, 1, 0, 1, me.peer_id)
    sealed = seal_part(me, header, meta, enc.payload)
    wire = sealed.to_bytes()
    body = {"group": meta["group"], "weight": 1000, "data": enc.to_wire()}
    envelope = seal(me, header, body)
    checks = {
        "expected_sender": me.peer_id,
        "run_id": _RUN_ID,
        "kinds": ("part",),
        "round_window": (0, 2),
    }
    payload = bytes(enc.payload)
    out = {
        "message_bytes": len(wire),
        "seal_s": _best(lambda: seal_part(me, header, meta, enc.payload)),
        "open_s": _best(lambda: open_part(wire, max_bytes=len(wire), **checks)),
        "envelope_seal_s": _best(lambda: seal(me, header, body)),
        "envelope_open_s": _best(lambda: open_envelope(envelope, **checks)),
        "sha256_body_s": _best(lambda: hashlib.sha256(payload).digest()),
        "blake3_body_s": _best(lambda: blake3.blake3(payload).digest()),
    }
    # The body needs no packing: all of sealing and opening is the signature's cost.
    out["sign_overhead_s"], out["verify_overhead_s"] = out["seal_s"], out["open_s"]
    # Per all-reduce one member seals its G-1 outgoing parts and its reduced part, and
    # opens G-1 incoming parts and G-1 reduced replies (its own it never re-opens); the
    # reduced part is about as large as one part.
    g = _MEMBERS
    out["seals_per_member"], out["opens_per_member"] = g, 2 * (g - 1)
    out["per_member_per_round_s"] = (
        g * out["sign_overhead_s"] + 2 * (g - 1) * out["verify_overhead_s"]
    )
    return out


# ---- report ---------------------------------------------------------------------------


def _plot(results: dict[str, dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    fig, (ax, ax_parts) = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.38
    for k, (mode, color) in enumerate((("off", "tab:gray"), ("on", "tab:blue"))):
        xs = [i + (k - 0.5) * width for i in range(len(keys))]
        ys = [results[key][mode].get("median_s") or 0.0 for key in keys]
        label = "verification on (trimmed mean, screening, audit)" if mode == "on" else "off"
        ax.bar(xs, ys, width, color=color, label=label)
    for i, key in enumerate(keys):
        ratio, top = (
            results[key].get("ratio"),
            max(
                results[key]["on"].get("median_s") or 0.0,
                results[key]["off"].get("median_s") or 0.0,
            ),
        )
        text = f"{ratio:.2f}x" if ratio else "n/a"
        ax.annotate(text, (i, top), ha="center", va="bottom", fontsize=9, fontweight="bold")
    ax.set_xticks(range(len(keys)), [_label(key) for key in keys])
    ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room for the ratio labels and the legend
    ax.set_ylabel("median seconds per all-reduce (all 4 members done)")
    ax.set_title(f"{_MEMBERS} members, one process, 127.0.0.1; ratio = on / off")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)

    parts = [
        ("signatures (off and on)", lambda r: r["signatures"]["per_member_per_round_s"]),
        ("reduce, off", lambda r: r["off"].get("per_member_per_round_s", {}).get("reduce_s")),
        ("screening, on", lambda r: _part(r["on"], "screen_s")),
        ("trimmed mean, on", lambda r: _part(r["on"], "aggregate_s")),
        ("SQLite audit + reputation, on", lambda r: _part(r["on"], "sqlite_s")),
        ("check reduced part", lambda r: _part(r["on"], "check_reduced_s")),
    ]
    width = 0.8 / len(parts)
    for k, (label, get) in enumerate(parts):
        xs = [i + (k - (len(parts) - 1) / 2) * width for i in range(len(keys))]
        ys = [1e3 * (get(results[key]) or 0.0) for key in keys]
        ax_parts.bar(xs, ys, width, label=label)
    ax_parts.set_xticks(range(len(keys)), [_label(key) for key in keys])
    ax_parts.set_yscale("log")  # the parts span three orders of magnitude
    ax_parts.set_ylabel("ms per member per all-reduce (log)")
    ax_parts.set_title("Where the time goes (one member's share)")
    ax_parts.grid(axis="y", alpha=0.3)
    ax_parts.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _part(record: dict[str, Any], name: str) -> float | None:
    return record.get("per_member_per_round_s", {}).get(name)


def _label(key: str) -> str:
    n, codec = key.split("/")
    return f"{int(n) / 1e6:g}M, {codec}"


def _measure_all(sizes: list[int], rounds: Iterator[int], results: dict[str, dict]) -> None:
    """Fills ``results`` with on/off timings and the signature cost per size and codec."""
    with tempfile.TemporaryDirectory(prefix="atoll-verification-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        with _transports(tmp) as (transports, identities):
            for n in sizes:
                for codec in _CODECS:
                    entry: dict[str, Any] = {"n": n, "codec": codec}
                    try:
                        entry.update(_measure(transports, identities, n, codec, rounds, tmp))
                    except Exception as e:  # report it; the other cells still run
                        error = {"error": f"{type(e).__name__}: {e}", "median_s": None}
                        entry.update(off=error, on=dict(error))
                    results[f"{n}/{codec}"] = entry
        for entry in results.values():
            on, off = entry["on"].get("median_s"), entry["off"].get("median_s")
            entry["ratio"] = on / off if on and off else None
            entry["overhead_pct"] = 100 * (on / off - 1) if on and off else None
            sig = _signature_cost(entry["n"], entry["codec"], identities)
            if off:
                sig["share_of_round_per_member"] = sig["per_member_per_round_s"] / off
                # here all four members share one interpreter, so their costs add up
                sig["share_of_round_all_members"] = _MEMBERS * sig["per_member_per_round_s"] / off
            entry["signatures"] = sig


def run(quick: bool, out_dir: pathlib.Path) -> dict:
    """Times 4-member all-reduces with verification on and off, and signatures apart.

    Args:
        quick: 1M values instead of 1M and 10M.
        out_dir: folder for ``verification.json`` and ``verification.png``; created if missing.

    Returns:
        The dict written to ``verification.json``: per ``"N/codec"`` the repeat times
        and median with verification ``on`` and ``off``, their ``ratio`` (on / off),
        where the time goes per member and round (``per_member_per_round_s``), and the
        signature micro-benchmark with its share of the round (``signatures``). A
        measurement that failed has an ``error`` instead of times.
    """
    sizes = [1_000_000] if quick else [1_000_000, 10_000_000]
    results: dict[str, dict[str, Any]] = {}
    rounds = iter(range(1, 10**6))
    # One intra-op thread, as a node gets when several share a machine (run.threads):
    # with more threads than free cores, OpenMP's waiting turns each small tensor op
    # into tens of milliseconds and the measurement into one of oversubscription.
    threads = torch.get_num_threads()
    torch.set_num_threads(_TORCH_THREADS)
    try:
        _measure_all(sizes, rounds, results)
    finally:
        torch.set_num_threads(threads)
    report = {
        "benchmark": "verification",
        "quick": quick,
        "members": _MEMBERS,
        "repeats": _REPEATS,
        "torch_threads": _TORCH_THREADS,
        "policy": {"aggregator": "trimmed_mean", "screening": True},
        "target": "ratio on/off below 1.10",
        "results": results,
        "notes": {
            "timing": "one untimed warm-up per mode, then repeats alternating off and on "
            "(off-on, on-off, ...) on the same services; each: all four members start "
            "AllReduceService.run at once; the time is until all four are done",
            "on": "reducer and judge = node.verifier.Verifier (screening, trimmed "
            "mean, audit rows and reputations in a fresh SQLite file per member)",
            "off": "default token-weighted mean reducer, a judge that accepts everything",
            "signatures": "always on; seal_part/open_part of one part (the whole cost: the "
            "body travels raw), next to the former msgpack envelope and to SHA-256 and "
            "BLAKE3 over the body alone, "
            "best of 7; per_member_per_round_s = G sealed + 2(G-1) opened part-sized "
            "messages; share_of_round_* divide by the median 'off' round",
            "per_member_per_round_s": "time inside the reducer (reduce_s; of it "
            "screen_s and aggregate_s), the SQLite stores (sqlite_s, every audit and "
            "reputation call) and check_reduced, summed over members and divided by "
            "members x repeats",
            "one_process": "all four members and their event loops share one Python "
            "process and two cores, so CPU work of one member delays the others",
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "verification.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(results, out_dir / "verification.png")
    return report
