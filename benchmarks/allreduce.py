"""All-reduce benchmark: Atoll's butterfly all-reduce against hivemind and gloo.

Four peers average N float32 values, each peer in its own spawned process on
127.0.0.1, for each method run one after the other in the same call
(``smoke``: two peers, 20,000 values, one repeat):

* ``atoll``: :class:`protocol.averaging.allreduce.AllReduceService` over :class:`Transport`
  (codec ``none``, signed parts); the group is given, so there is no matchmaking.
* ``hivemind``: ``hivemind.averaging.DecentralizedAverager`` with NoCompression.
  Its ``step()`` always matchmakes first; the step is split with
  ``require_trigger`` into the matchmaking part and the all-reduce part.
* ``gloo``: ``torch.distributed.all_reduce`` then a division, the floor reference.
* ``int8_p2pd``, ``topk_p2pd``, ``int8_direct``, ``topk_direct``: Atoll with ``int8``
  or ``topk`` parts over p2pd or the direct TCP plane, timing the encode and decode of
  the peer's vector too (:mod:`benchmarks._allreduce_codecs`); at 10M and 50M values
  in quick mode as well.

A parent process starts the peers and releases every repeat at one wall-clock
instant; a repeat's time is the slowest peer's. One untimed warm-up repeat comes
first (it opens the connections). Run it with
``python -m benchmarks allreduce [--quick]``; it writes ``allreduce.json`` and
``allreduce.png`` into the output folder.

Two methods whose difference is smaller than the spread between runs on a shared
machine are compared with ``python -m benchmarks.allreduce --alternate A B [--size N]
[--runs 4]``: runs of A and B alternate (ABBA...), 5 repeats each, and it prints the
median of each method's run medians (and, for Atoll's methods, bytes sent per peer).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import multiprocessing as mp
import os
import pathlib
import statistics
import tempfile
import threading
import time
import traceback
from typing import Any

import psutil
import torch

from benchmarks import _allreduce_codecs as codec_rows
from benchmarks._allreduce_report import NOTES, plot, ratios
from benchmarks._common import free_port, gloo_group, machine_info
from benchmarks._mode import Mode

__all__ = ["alternate", "method_sizes", "run"]

_PEERS = 4
_SMOKE_PEERS = 2
_TOLERANCE = 1e-5
_SETUP_TIMEOUT = 120.0  # starting p2pd, a DHT and the peer in a cold interpreter on a busy box
_STEP_TIMEOUT = 300.0
_GO_DELAY = 0.3  # seconds between the parent's release message and the common start
_METHODS = (
    "gloo",
    "atoll",
    "atoll_streamed",
    "atoll_verified",
    "atoll_tcp",
    "atoll_tls",
    "hivemind",
    *codec_rows.METHODS,
)
_SIZES = (10_000_000, 50_000_000)
_SMOKE_SIZE = 20_000
# every method but gloo, whose rendezvous needs every rank at once
_JOINS_THROUGH_FIRST = frozenset(_METHODS) - {"gloo"}


# ---- the peers, one per worker process ------------------------------------------------


class _AtollPeer:
    def __init__(self, index: int, own: torch.Tensor, opts: dict) -> None:
        from protocol.averaging.allreduce import AllReduceService, AllReduceSettings
        from protocol.averaging.hooks import Hooks
        from protocol.p2p.transport import Transport, TransportConfig
        from verification.identity import Identity

        self.own = own
        # averaged into one tensor repeat after repeat, as hivemind's averager does
        self.out = torch.empty_like(own)
        identity = Identity.generate()
        key = pathlib.Path(opts["tmp"]) / f"atoll-{index}.key"
        identity.save(key)
        config = TransportConfig(
            identity_path=key,
            initial_peers=tuple(opts.get("initial_peers", ())),
            request_timeout=_SETUP_TIMEOUT,
            startup_timeout=_SETUP_TIMEOUT,
            data_plane=opts.get("data_plane", "p2pd"),
        )
        self.transport = Transport.start(config)
        settings = AllReduceSettings(
            run_id="bench",
            timeout=_STEP_TIMEOUT / 3,
            stream_reduce=bool(opts.get("streamed")),
            **opts.get("codec", {"codec": "none"}),
        )
        self.verifier = None
        if opts.get("verified"):
            # a node's whole verification layer: screening, trimmed mean (with 4 members it
            # trims nothing, so the result is still the exact mean), reputation, audit log
            from verification.policy import TrustPolicy
            from verification.verifier import Verifier

            self.verifier = Verifier(
                TrustPolicy(aggregator="trimmed_mean"),
                pathlib.Path(opts["tmp"]) / f"atoll-{index}.db",
                identity.peer_id,
            )
        hooks = Hooks()
        if self.verifier:
            verifier = self.verifier
            hooks = Hooks(verifier.reducer.reduce, verifier.reducer.stream_plan, judge=verifier)
        self.service = AllReduceService(self.transport, identity, settings, hooks)
        self.service.register()
        self.info = {"peer_id": identity.peer_id, "maddrs": self.transport.maddrs}

    def step(
        self, repeat: int, infos: list[dict], vector: torch.Tensor | None = None
    ) -> tuple[dict, torch.Tensor]:
        """One all-reduce of ``vector`` (default: this peer's own)."""
        group = [info["peer_id"] for info in infos]
        round_ = repeat + 1
        # the owner side only accepts rounds near the one it is in
        self.service.clock.start(round_)
        t0 = time.perf_counter()
        taken = self.service.context.results_streamed
        own = self.own if vector is None else vector
        run = self.service.run(round_, 0, group, own, 1, out=self.out)
        result = self.transport.run(run, _STEP_TIMEOUT)
        seconds = time.perf_counter() - t0
        if not result.complete:
            raise RuntimeError(f"round {round_} incomplete: fallback parts {result.fallback_parts}")
        timing = {
            "seconds": seconds,
            "bytes_sent": result.bytes_sent,
            "reduce_s": result.reduce_seconds,
            "streamed_share": result.streamed_share,
            # of the others' results, the share taken as they were reduced (with a trailer)
            "results_streamed": (self.service.context.results_streamed - taken)
            / max(1, len(group) - 1),
        }
        timing["receive_buffers"] = self.service.context.pool.allocated
        return timing, result.vector

    def close(self) -> None:
        self.transport.shutdown()
        if self.verifier is not None:
            self.verifier.close()


def _atoll_streamed(index: int, own: torch.Tensor, opts: dict) -> _AtollPeer:
    return _AtollPeer(index, own, dict(opts, streamed=True))


def _atoll_verified(index: int, own: torch.Tensor, opts: dict) -> _AtollPeer:
    return _AtollPeer(index, own, dict(opts, verified=True))


def _atoll_tcp(index: int, own: torch.Tensor, opts: dict) -> _AtollPeer:
    return _AtollPeer(index, own, dict(opts, data_plane="tcp"))


def _atoll_tls(index: int, own: torch.Tensor, opts: dict) -> _AtollPeer:
    return _AtollPeer(index, own, dict(opts, data_plane="tls"))


def _codec_peer(method: str, index: int, own: torch.Tensor, opts: dict) -> Any:
    codec, plane = codec_rows.METHODS[method]
    settings = codec_rows.settings_args(codec)
    exchange = _AtollPeer(index, own, dict(opts, data_plane=plane, codec=settings))
    inputs = (_vector(own.numel(), i) for i in range(opts["peers"]))
    return codec_rows.CodecPeer(exchange, codec, inputs)


class _HivemindPeer:
    def __init__(self, index: int, own: torch.Tensor, opts: dict) -> None:
        import hivemind
        from hivemind.averaging import DecentralizedAverager
        from hivemind.compression import NoCompression

        self.own = own
        peers = opts["peers"]
        self.dht = hivemind.DHT(
            initial_peers=list(opts.get("initial_peers", ())),
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            start=True,
        )
        self.averager = None
        self.averager = DecentralizedAverager(
            [own.clone()],
            self.dht,
            start=True,
            prefix="bench",
            target_group_size=peers,
            min_group_size=peers,
            # generous: on two busy cores a peer may declare itself late
            min_matchmaking_time=10.0,
            request_timeout=5.0,
            compression=NoCompression(),
        )
        self.info = {"maddrs": [str(m) for m in self.dht.get_visible_maddrs()]}

    def step(self, repeat: int, infos: list[dict]) -> tuple[dict, torch.Tensor]:
        from hivemind.averaging.control import AveragingStage

        # every repeat averages the original vectors, not the previous result
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(self.own)
        t0 = time.perf_counter()
        control = self.averager.step(wait=False, require_trigger=True, timeout=_STEP_TIMEOUT)
        # the stage lives in shared memory, so polling it costs no round trip
        while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
            if time.perf_counter() - t0 > _STEP_TIMEOUT:
                control.cancel()
                raise TimeoutError("hivemind matchmaking did not finish")
            time.sleep(0.002)
        t1 = time.perf_counter()
        control.allow_allreduce()
        control.result(_STEP_TIMEOUT)
        t2 = time.perf_counter()
        with self.averager.get_tensors() as tensors:
            out = tensors[0].clone()
        timing = {"seconds": t2 - t0, "matchmaking_s": t1 - t0, "allreduce_s": t2 - t1}
        return timing, out

    def close(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
        self.dht.shutdown()


class _GlooPeer:
    def __init__(self, index: int, own: torch.Tensor, opts: dict) -> None:
        self.own = own
        self.peers = opts["peers"]
        self._group = contextlib.ExitStack()
        self.dist = self._group.enter_context(
            gloo_group(opts["port"], index, self.peers, timeout_s=_SETUP_TIMEOUT)
        )
        self.info = {}

    def step(self, repeat: int, infos: list[dict]) -> tuple[dict, torch.Tensor]:
        x = self.own.clone()  # all_reduce works in place
        t0 = time.perf_counter()
        self.dist.all_reduce(x)
        x /= self.peers
        return {"seconds": time.perf_counter() - t0}, x

    def close(self) -> None:
        self._group.close()


_PEER_TYPES = {
    "atoll": _AtollPeer,
    "atoll_streamed": _atoll_streamed,
    "atoll_verified": _atoll_verified,
    "atoll_tcp": _atoll_tcp,
    "atoll_tls": _atoll_tls,
    "hivemind": _HivemindPeer,
    "gloo": _GlooPeer,
    **{m: functools.partial(_codec_peer, m) for m in codec_rows.METHODS},
}


def _peer_type(method: str) -> Any:
    """A method of this module, or ``"package.module:Class"`` for another benchmark's peer
    (which must join through the first peer and have this module's peer interface)."""
    if ":" not in method:
        return _PEER_TYPES[method]
    import importlib

    module, name = method.split(":", 1)
    return getattr(importlib.import_module(module), name)


def _vector(n: int, index: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(index))


def _reference_mean(n: int, peers: int) -> torch.Tensor:
    total = torch.zeros(n, dtype=torch.float64)
    for i in range(peers):
        total += _vector(n, i)
    return (total / peers).float()


class _RssSampler:
    """The peak resident memory of this process during a step, sampled every 20 ms."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._peak = 0
        self._active = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            if self._active.is_set():
                self._peak = max(self._peak, self._process.memory_info().rss)

    def rss(self) -> int:
        return self._process.memory_info().rss

    def start(self) -> None:
        self._peak = self.rss()
        self._active.set()

    def stop(self) -> int:
        self._active.clear()
        return max(self._peak, self.rss())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


def _worker(method: str, index: int, n: int, opts: dict, conn: Any) -> None:
    """Entry point of one peer's process: set up, then run a repeat per "go" message."""
    torch.set_num_threads(1)
    # A spawned child inherits "spawn" as its start method; hivemind's DHT and averager
    # processes hold unpicklable state and expect Linux's default fork, as in a normal node.
    mp.set_start_method("fork", force=True)
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    logging.basicConfig(level=logging.WARNING)
    peer = None
    sampler = _RssSampler()
    try:
        own = _vector(n, index)
        peer = _peer_type(method)(index, own, opts)
        # a peer may average other vectors than _vector's (it then says what it expects)
        reference = getattr(peer, "reference", None)
        if reference is None:
            reference = _reference_mean(n, opts["peers"])
        # a peer whose result carries a codec's error checks it against its bound
        check = getattr(peer, "check", None)
        baseline = sampler.rss()
        conn.send(("ready", peer.info))
        while conn.poll(_SETUP_TIMEOUT + _STEP_TIMEOUT):
            message = conn.recv()
            if message[0] == "stop":
                break
            _, repeat, start_at, infos = message
            time.sleep(max(0.0, start_at - time.time()))
            sampler.start()
            timing, result = peer.step(repeat, infos)
            # this process only (for hivemind, not its averager's process)
            timing["rss_step_extra_mb"] = (sampler.stop() - baseline) / 2**20
            timing["rss_after_mb"] = sampler.rss() / 2**20
            timing["max_abs_error"] = (result - reference).abs().max().item()
            if check is not None:
                timing.update(check(result))
            conn.send(("done", repeat, timing))
    except BaseException:
        with contextlib.suppress(OSError):  # the parent may be gone already
            conn.send(("error", traceback.format_exc()))
    finally:
        sampler.close()
        if peer is not None:
            peer.close()
        conn.close()


# ---- the parent: start, release, collect, clean up ------------------------------------


def _receive(conn: Any, proc: mp.Process, timeout: float, expect: str) -> tuple:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: no {expect!r} within {timeout:.0f}s")
        if not proc.is_alive() and not conn.poll(0.2):
            raise RuntimeError(f"{proc.name} exited with code {proc.exitcode}")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(f"{proc.name} failed:\n{message[1]}")
    if message[0] != expect:
        raise RuntimeError(f"{proc.name}: expected {expect!r}, got {message[0]!r}")
    return message


class _Swarm:
    """The peer processes of one (method, n) measurement and everything they start."""

    def __init__(self, method: str, n: int, tmp: str, peers: int = _PEERS) -> None:
        self.method, self.n, self.peers = method, n, peers
        self.opts: dict = {"tmp": tmp, "port": free_port(), "peers": peers}
        self.ctx = mp.get_context("spawn")  # never fork a parent that may hold threads
        self.procs: list[mp.Process] = []
        self.conns: list[Any] = []
        self.descendants: dict[int, psutil.Process] = {}
        self.infos: list[dict] = []

    def _spawn(self, index: int) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_worker,
            args=(self.method, index, self.n, dict(self.opts), child),
            name=f"{self.method}-peer-{index}",
            daemon=False,  # a daemonic process may not start p2pd, a DHT or an averager
        )
        proc.start()
        child.close()
        self.procs.append(proc)
        self.conns.append(parent)

    def start(self) -> None:
        if self.method in _JOINS_THROUGH_FIRST or ":" in self.method:
            self._spawn(0)
            first = _receive(self.conns[0], self.procs[0], _SETUP_TIMEOUT, "ready")[1]
            self.opts["initial_peers"] = first["maddrs"]
            self.infos.append(first)
            for i in range(1, self.peers):
                self._spawn(i)
        else:
            for i in range(self.peers):
                self._spawn(i)
        for conn, proc in list(zip(self.conns, self.procs))[len(self.infos) :]:
            self.infos.append(_receive(conn, proc, _SETUP_TIMEOUT, "ready")[1])
        self._note_descendants()

    def repeat(self, index: int) -> list[dict]:
        start_at = time.time() + _GO_DELAY
        for conn in self.conns:
            conn.send(("go", index, start_at, self.infos))
        return [
            _receive(c, p, _STEP_TIMEOUT + 30, "done")[2] for c, p in zip(self.conns, self.procs)
        ]

    def _note_descendants(self) -> None:
        # p2pd, DHT and averager processes: ended here if a peer leaves them behind
        for proc in self.procs:
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    self.descendants[child.pid] = child
            except psutil.NoSuchProcess:
                pass

    def close(self) -> None:
        self._note_descendants()
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a peer that failed has closed its end
                conn.send(("stop",))
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        left = [p for p in self.descendants.values() if p.is_running()]
        for p in left:
            p.terminate()
        _, alive = psutil.wait_procs(left, timeout=5)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=5)
        for conn in self.conns:
            conn.close()


def _summarize(times: list[float], n: int) -> dict:
    median = statistics.median(times)
    return {"times": times, "median_s": median, "throughput_MBps": 4 * n / median / 1e6}


def _measure(method: str, n: int, repeats: int, tmp: str, peers: int = _PEERS) -> dict:
    """Runs one warm-up and ``repeats`` timed all-reduces of ``n`` values with ``method``."""
    record: dict[str, Any] = {"n": n}
    swarm = _Swarm(method, n, tmp, peers)
    try:
        t0 = time.perf_counter()
        swarm.start()
        record["setup_s"] = time.perf_counter() - t0
        record["warmup_s"] = max(t["seconds"] for t in swarm.repeat(0))
        rows = [swarm.repeat(r) for r in range(1, repeats + 1)]
    except Exception as e:
        record.update(error=str(e), times=[], median_s=None, throughput_MBps=None, correct=False)
        return record
    finally:
        swarm.close()
    record.update(_summarize([max(t["seconds"] for t in row) for row in rows], n))
    error = max(t["max_abs_error"] for row in rows for t in row)
    record.update(max_abs_error=error, correct=error <= _TOLERANCE)
    if method == "hivemind":
        for part in ("matchmaking_s", "allreduce_s"):
            times = [max(t[part] for t in row) for row in rows]
            record[part.replace("_s", "_times")] = times
            record[part.replace("_s", "_median_s")] = statistics.median(times)
    if method.startswith("atoll") or method in codec_rows.METHODS:
        record.update(_atoll_fields(rows, record["times"], n))
    if method in codec_rows.METHODS:
        # a codec's result is the mean only up to its quantization: checked against its bound
        record.update(codec_rows.verdict([t for row in rows for t in row]))
        record["encode_times"] = [max(t["encode_s"] for t in row) for row in rows]
        record["encode_median_s"] = statistics.median(record["encode_times"])
    return record


def _atoll_fields(rows: list[list[dict]], times: list[float], n: int) -> dict[str, Any]:
    """What Atoll's peers report beyond the time: bytes, reduction, memory."""
    record: dict[str, Any] = {"bytes_sent_per_peer": max(t["bytes_sent"] for t in rows[-1])}
    # an owner's time between its last part in and its signed result: all a reduction
    # streamed chunk by chunk could take off a step on an otherwise idle machine
    reduce = [max(t["reduce_s"] for t in row) for row in rows]
    record["reduce_times"] = reduce
    record["reduce_share"] = statistics.median(r / s for r, s in zip(reduce, times))
    # the share of each owner's part reduced while the parts still arrived
    record["streamed_share"] = statistics.median(t["streamed_share"] for row in rows for t in row)
    record["results_streamed_share"] = statistics.mean(
        t["results_streamed"] for row in rows for t in row
    )
    # memory a step adds to a peer's process (its own vector, the output and the
    # reference mean are allocated before), per repeat, and how it moved across repeats
    record["rss_step_extra_mb"] = [max(t["rss_step_extra_mb"] for t in row) for row in rows]
    record["rss_growth_mb"] = max(t["rss_after_mb"] for t in rows[-1]) - max(
        t["rss_after_mb"] for t in rows[0]
    )
    record["fragment_mb"] = 4 * n / 2**20
    record["receive_buffers_allocated"] = [max(t["receive_buffers"] for t in row) for row in rows]
    return record


# ---- report ---------------------------------------------------------------------------


def method_sizes(method: str, quick: bool, smoke: bool = False) -> list[int]:
    """The vector sizes ``method`` runs at: the int8 and topk rows at 10M and 50M values
    in quick mode too, the others at 10M only there."""
    if smoke:
        return [_SMOKE_SIZE]
    return list(_SIZES) if not quick or method in codec_rows.METHODS else [_SIZES[0]]


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Times a 4-peer float32 average with Atoll, hivemind and gloo, side by side.

    Args:
        mode: what it runs: ``quick``: 3 repeats instead of 5, and 10M values only instead
            of 10M and 50M (the int8 and topk rows keep both); ``smoke``: 2 peers, 20,000
            values, 1 repeat: a check that every method runs.
        out_dir: folder for ``allreduce.json`` and ``allreduce.png``; created if missing.

    Returns:
        The dict written to ``allreduce.json``: per method and size the repeat times
        (slowest peer), median, throughput in MB/s of one peer's input, correctness
        against the true mean (for int8 and topk: against their quantization bound),
        bytes sent per peer for Atoll's methods, and the ratios of hivemind's and
        gloo's medians to Atoll's and of topk's time and bytes to int8's.
        A method that could not run has an ``error`` instead of times.
    """
    repeats = 1 if mode.smoke else 3 if mode.quick else 5
    peers = _SMOKE_PEERS if mode.smoke else _PEERS
    plan = {m: method_sizes(m, mode.quick, mode.smoke) for m in _METHODS}
    results: dict[str, dict[str, dict]] = {m: {} for m in _METHODS}
    with tempfile.TemporaryDirectory(prefix="atoll-bench-") as tmp:
        for n in sorted({n for sizes in plan.values() for n in sizes}):
            for method in (m for m in _METHODS if n in plan[m]):
                results[method][str(n)] = _measure(method, n, repeats, tmp, peers)
    report = {
        "benchmark": "allreduce",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "peers": peers,
        "repeats": repeats,
        "tolerance": _TOLERANCE,
        "results": results,
        "ratios": ratios(results),
        "notes": NOTES,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "allreduce.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, peers, out_dir / "allreduce.png")
    return report


def alternate(methods: list[str], n: int, runs: int = 4, repeats: int = 5) -> dict[str, Any]:
    """Runs ``methods`` in alternating order (ABBA...) ``runs`` times each, ``repeats``
    timed all-reduces of ``n`` values per run; the median of each method's run medians,
    its bytes sent per peer (Atoll's methods) and whether every run was correct."""
    unknown = [m for m in methods if m not in _PEER_TYPES]
    if unknown or len(methods) < 2:
        raise ValueError(f"two or more of {', '.join(_PEER_TYPES)}, got {methods}")
    medians: dict[str, list[float]] = {m: [] for m in methods}
    sent: dict[str, int | None] = {}
    correct: dict[str, bool] = {m: True for m in methods}
    with tempfile.TemporaryDirectory(prefix="atoll-bench-") as tmp:
        for run_ in range(runs):
            for method in methods if run_ % 2 == 0 else list(reversed(methods)):
                record = _measure(method, n, repeats, tmp)
                if record.get("error"):
                    raise RuntimeError(f"{method}: {record['error']}")
                medians[method].append(record["median_s"])
                sent[method] = record.get("bytes_sent_per_peer")
                correct[method] = correct[method] and record["correct"]
    return {
        "n": n,
        "runs": runs,
        "repeats": repeats,
        "run_medians_s": medians,
        "median_s": {m: statistics.median(v) for m, v in medians.items()},
        "bytes_sent_per_peer": sent,
        "correct": correct,
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=alternate.__doc__)
    parser.add_argument("--alternate", nargs="+", required=True, metavar="METHOD")
    parser.add_argument("--size", type=int, default=10_000_000)
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps(alternate(args.alternate, args.size, args.runs), indent=2))
