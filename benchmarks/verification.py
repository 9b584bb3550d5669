"""Verification overhead: what screening, robust aggregation and the audit log cost a round.

Four members, each in its own process with its own :class:`~protocol.p2p.transport.Transport`
(its own p2pd and DHT), its own SQLite file and its own event loop, as on real machines,
all-reduce a float32 vector together on 127.0.0.1, the group given, for codecs
``int8`` and ``none``:

* **verification on**: every service's reducer and judge is a
  :class:`verification.verifier.Verifier` with ``TrustPolicy(aggregator="trimmed_mean",
  screening=True)`` writing its audit rows and reputations to a SQLite file, exactly
  as a node does;
* **verification off**: the default token-weighted mean, a judge that accepts everything.

Signatures are part of Atoll's wire format in both cases, so their cost is measured
apart: a micro-benchmark seals and opens one part in the part wire format, next to the
msgpack envelope parts used before and to SHA-256 and BLAKE3 over the body, and the
cost, times the messages one member seals and opens per all-reduce, is reported as a
share of the round. The same four members run both modes, switching reducer and judge
between rounds: one untimed warm-up of each, then 40 repeats of each, off and on in
turn (off-on, then on-off), so that both see the same load on a shared machine (a
smoke run: 2 members, 20,000 values, codec ``int8``, 1 repeat of each). The
parent releases every round at one wall-clock instant (:mod:`benchmarks.allreduce`'s
machinery); a round's time is the slowest member's. Run it with
``python -m benchmarks verification [--quick]``; it writes ``verification.json`` and
``verification.png`` into the output folder.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pathlib
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import blake3
import torch

from benchmarks._common import figure, machine_info
from benchmarks._mode import Mode
from protocol.averaging.allreduce import AllReduceService
from protocol.averaging.hooks import Judge
from protocol.averaging.parts import (
    AllReduceResult,
    AllReduceSettings,
    part_bounds,
    weighted_mean_reducer,
)
from protocol.p2p.transport import Transport, TransportConfig
from protocol.wire import codec as codecs
from protocol.wire.messages import Header, open_envelope, seal
from protocol.wire.partwire import open_part, seal_part
from verification import reduction as reduction_module
from verification.identity import Identity
from verification.policy import TrustPolicy
from verification.verifier import Verifier

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


@dataclass(frozen=True)
class _Plan:
    """What one run measures: per size and codec, ``repeats`` rounds of each mode."""

    sizes: tuple[int, ...]
    codecs: tuple[str, ...] = _CODECS
    members: int = _MEMBERS
    repeats: int = _REPEATS


def _plan(quick: bool, smoke: bool) -> _Plan:
    if smoke:
        return _Plan((20_000,), codecs=("int8",), members=2, repeats=1)
    return _Plan((1_000_000,) if quick else (1_000_000, 10_000_000))


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
        for owner, method in _SQLITE_CALLS:
            target = getattr(self, owner)
            setattr(target, method, clock.wrap("sqlite_s", getattr(target, method)))
        self.reducer.reduce = clock.wrap("reduce_s", self.reducer.reduce)  # type: ignore[method-assign]
        self.check_reduced = clock.wrap("check_reduced_s", self.check_reduced)  # type: ignore[method-assign]


# ---- one member per process ------------------------------------------------------------


_WARMUPS = 2  # one untimed round per mode


def _mode(repeat: int) -> str:
    """Verification off or on for a repeat: one warm-up of each, then pairs alternating
    off-on and on-off, so both modes see the same drift of a shared machine."""
    if repeat < _WARMUPS:
        return ("off", "on")[repeat]
    pair, second = divmod(repeat - _WARMUPS, 2)
    first = "off" if pair % 2 == 0 else "on"
    return first if not second else ("on" if first == "off" else "off")


class SwitchingPeer:
    """One member in its own process (as on real machines), with its own transport,
    all-reduce service and verifier, switching its reducer and judge between the modes
    before each round. Run through :class:`benchmarks.allreduce._Swarm`."""

    def __init__(self, index: int, own: torch.Tensor, opts: dict) -> None:
        torch.set_num_threads(_TORCH_THREADS)
        tmp = pathlib.Path(opts["tmp"])
        identity = Identity.generate()
        identity.save(tmp / f"verify-{index}.key")
        self.transport = Transport.start(
            TransportConfig(
                identity_path=tmp / f"verify-{index}.key",
                initial_peers=tuple(opts.get("initial_peers", ())),
                request_timeout=_TIMEOUT,
                startup_timeout=_TIMEOUT,
            )
        )
        vectors = _vectors(own.numel(), opts["peers"])
        self.own = vectors[index]
        self.reference = (sum(v.double() for v in vectors) / len(vectors)).float()
        self.out = torch.empty_like(self.own)
        self.clocks = {"off": _Clock(), "on": _Clock()}
        for name in ("screen", "aggregate"):  # split the verifier's reduce (this process only)
            timed = self.clocks["on"].wrap(f"{name}_s", getattr(reduction_module, name))
            setattr(reduction_module, name, timed)
        policy = TrustPolicy(aggregator="trimmed_mean", screening=True)
        db = tmp / f"verify-{own.numel()}-{opts['codec']}-{index}.db"
        self.verifier = _TimedVerifier(policy, db, identity.peer_id, self.clocks["on"])
        settings = AllReduceSettings(run_id=_RUN_ID, codec=opts["codec"], timeout=_TIMEOUT)
        self.service = AllReduceService(self.transport, identity, settings)
        self.service.register()
        plain = self.clocks["off"].wrap("reduce_s", weighted_mean_reducer)
        self.modes = {"off": (plain, Judge()), "on": (self.verifier.reducer.reduce, self.verifier)}
        self.info = {"peer_id": identity.peer_id, "maddrs": self.transport.maddrs}

    def step(self, repeat: int, infos: list[dict]) -> tuple[dict, torch.Tensor]:
        mode = _mode(repeat)
        self.service.context.reducer, self.service.context.judge = self.modes[mode]
        clock = self.clocks[mode]
        before, rejected = dict(clock.seconds), Counter(self.service.context.rejected)
        round_ = repeat + 1
        self.service.clock.start(round_)
        t0 = time.perf_counter()
        run = self.service.run(
            round_, 0, [i["peer_id"] for i in infos], self.own, 1000, out=self.out
        )
        result = self.transport.run(run, _TIMEOUT * 3)
        timing = {
            "seconds": time.perf_counter() - t0,
            "bytes_sent": result.bytes_sent,
            "mode": mode,
            "clock": {k: v - before.get(k, 0.0) for k, v in clock.seconds.items()},
            "rejected": dict(Counter(self.service.context.rejected) - rejected),
            "incomplete": None if result.complete else _incomplete(round_, 0, result),
        }
        return timing, result.vector

    def close(self) -> None:
        self.transport.shutdown()
        self.verifier.close()


def _vectors(n: int, members: int) -> list[torch.Tensor]:
    # Pseudo-gradients of one model share a direction; independent noise alone would
    # make screening judge a situation that never happens in training.
    gen = torch.Generator().manual_seed(n)
    common = torch.randn(n, generator=gen)
    return [common + 0.5 * torch.randn(n, generator=gen) for _ in range(members)]


def _measure(n: int, codec: str, tmp: pathlib.Path, plan: _Plan) -> dict[str, dict[str, Any]]:
    """Two warm-ups and ``plan.repeats`` timed all-reduces of ``n`` values per mode, each
    member in its own process; a round's time is the slowest member's."""
    from benchmarks.allreduce import _Swarm

    swarm = _Swarm(f"{__name__}:SwitchingPeer", n, str(tmp), plan.members)
    swarm.opts["codec"] = codec
    times: dict[str, list[float]] = {"off": [], "on": []}
    seconds: dict[str, Counter[str]] = {"off": Counter(), "on": Counter()}
    rejected: dict[str, Counter[str]] = {"off": Counter(), "on": Counter()}
    incomplete: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    bytes_sent: dict[str, int] = {}
    errors: list[float] = []
    try:
        swarm.start()
        for repeat in range(_WARMUPS + 2 * plan.repeats):
            row = swarm.repeat(repeat)
            mode = row[0]["mode"]
            if repeat < _WARMUPS:
                continue
            times[mode].append(max(t["seconds"] for t in row))
            for member, t in enumerate(row):
                seconds[mode].update(t["clock"])
                rejected[mode].update(t["rejected"])
                if t["incomplete"]:  # kept in the times: a lost part is part of the cost
                    incomplete[mode].append(dict(t["incomplete"], member=member))
            bytes_sent[mode] = row[0]["bytes_sent"]
            errors += [t["max_abs_error"] for t in row]
    finally:
        swarm.close()
    out: dict[str, Any] = {}
    for mode in ("off", "on"):
        out[mode] = {
            "times": times[mode],
            "median_s": statistics.median(times[mode]),
            "per_member_per_round_s": {
                k: v / (plan.repeats * plan.members) for k, v in sorted(seconds[mode].items())
            },
            "rejected": dict(rejected[mode]),
            "incomplete": incomplete[mode],
            "bytes_sent_per_member": bytes_sent[mode],
        }
    out["max_abs_error_vs_mean"] = max(errors)
    return out


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
    g = len(identities)
    lo, hi = part_bounds(n, g, 256)[1]
    enc = codecs.encode(_vectors(n, g)[1][lo:hi], codec)
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
    out["seals_per_member"], out["opens_per_member"] = g, 2 * (g - 1)
    out["per_member_per_round_s"] = (
        g * out["sign_overhead_s"] + 2 * (g - 1) * out["verify_overhead_s"]
    )
    return out


# ---- report ---------------------------------------------------------------------------


def _plot(results: dict[str, dict[str, Any]], members: int, path: pathlib.Path) -> None:
    keys = list(results)
    with figure(path, 1, 2, figsize=(14, 4.5)) as (fig, (ax, ax_parts)):
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
        ax.set_ylabel(f"median seconds per all-reduce (all {members} members done)")
        ax.set_title(f"{members} members, one process each, 127.0.0.1; ratio = on / off")
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


def _part(record: dict[str, Any], name: str) -> float | None:
    return record.get("per_member_per_round_s", {}).get(name)


def _label(key: str) -> str:
    n, codec = key.split("/")
    return f"{int(n) / 1e6:g}M, {codec}"


def _measure_all(plan: _Plan, results: dict[str, dict]) -> None:
    """Fills ``results`` with on/off timings and the signature cost per size and codec."""
    identities = [Identity.generate() for _ in range(plan.members)]
    with tempfile.TemporaryDirectory(prefix="atoll-verification-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        for n in plan.sizes:
            for codec in plan.codecs:
                entry: dict[str, Any] = {"n": n, "codec": codec}
                try:
                    entry.update(_measure(n, codec, tmp, plan))
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
        entry["signatures"] = sig


_NOTES = {
    "timing": "one untimed warm-up per mode, then repeats alternating off and on "
    "(off-on, on-off, ...) on the same services; each: all four members, each in its "
    "own process with its own transport, start AllReduceService.run at one "
    "wall-clock instant; the time is the slowest member's",
    "on": "reducer and judge = verification.verifier.Verifier (screening, trimmed "
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
    "processes": "each member is its own process (its own transport, p2pd, DHT and "
    "SQLite file); the four share this machine's cores",
}
"""How each figure of the report was taken."""


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Times 4-member all-reduces with verification on and off, and signatures apart.

    Args:
        mode: what it runs: ``quick``: 1M values instead of 1M and 10M; ``smoke``: 2
            members, 20,000 values, codec int8, 1 repeat: a check that it runs.
        out_dir: folder for ``verification.json`` and ``verification.png``; created if missing.

    Returns:
        The dict written to ``verification.json``: per ``"N/codec"`` the repeat times
        and median with verification ``on`` and ``off``, their ``ratio`` (on / off),
        where the time goes per member and round (``per_member_per_round_s``), and the
        signature micro-benchmark with its share of the round (``signatures``). A
        measurement that failed has an ``error`` instead of times.
    """
    plan = _plan(mode.quick, mode.smoke)
    results: dict[str, dict[str, Any]] = {}
    # One intra-op thread per member, as a node gets when several share a machine
    # (run.threads): with more threads than free cores, OpenMP's waiting turns each small
    # tensor op into tens of milliseconds and the measurement into one of oversubscription.
    threads = torch.get_num_threads()
    torch.set_num_threads(_TORCH_THREADS)
    try:
        _measure_all(plan, results)
    finally:
        torch.set_num_threads(threads)
    report = {
        "benchmark": "verification",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "members": plan.members,
        "repeats": plan.repeats,
        "torch_threads": _TORCH_THREADS,
        "policy": {"aggregator": "trimmed_mean", "screening": True},
        "target": "ratio on/off below 1.10",
        "results": results,
        "notes": dict(_NOTES),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "verification.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(results, plan.members, out_dir / "verification.png")
    return report
