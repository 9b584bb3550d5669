"""``atoll plan``: what a run's syncs cost on a link, before anything is started.

A site planning a run across distant sites needs to know, in advance, how many bytes
each sync sends, how long it takes on its link and whether training hides it. The
model, per node and per fragment sync:

* a fragment of ``params / fragments`` values encodes to ``fragment_bytes``
  (:func:`protocol.wire.codec.encoded_size`: 4 bytes a value for ``none``, 2 for
  fp16/bf16, 1 plus a float32 scale per block for int8, half that for int4);
* in a butterfly group of ``G`` members a node sends its part to every other owner and
  the reduced result of the part it owns to every other member:
  ``2 (G - 1) / G × fragment_bytes`` (two sites: exactly the fragment);
* the sync takes ``sent × 8 / bandwidth`` on the link plus ``round_trips`` round trips
  (fibre: 5 µs a km each way; 1 ms of round trip per 100 km) plus a fixed
  ``overhead_seconds`` (matchmaking and commit on the swarm's side; 0.58 s was
  measured on loopback by the ``wan`` benchmark);
* ``steps`` trigger: a sync's result is applied ``tau`` inner steps after it started,
  so ``tau × step_seconds`` of compute hide it and the rest is waiting; the round is
  ``H × step_seconds`` of compute plus ``fragments`` waits;
* ``seconds`` trigger: nodes never wait; a sync must end within its round (less a
  5 % margin) or it fails and the work goes into the next one.

The smallest ``H`` that keeps utilization at or above 95 % follows. Nothing here
measures anything; ``README.md`` compares it with the ``wan`` benchmark's links.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["ONE_WAY_SECONDS_PER_KM", "PlanInput", "parse_count", "plan"]

ONE_WAY_SECONDS_PER_KM = 5e-6
"""Light in fibre: about 5 µs per km one way."""
TARGET_UTILIZATION = 0.95
_MARGIN = 0.05  # of a round, as the node keeps for an exchange on the wall clock
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """``"1T"``, ``"7B"``, ``"480k"``, ``"1.5e9"`` or ``"478720"`` as a whole number.

    Raises:
        ValueError: anything else, or a count below 1.
    """
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not found:
        raise ValueError(f"{text!r}: expected a number such as 1T, 7B, 480k or 478720")
    value = float(found.group(1)) * _SUFFIXES[found.group(2)]
    if value < 1:
        raise ValueError(f"{text!r}: a model has at least one parameter")
    return int(round(value))


@dataclass(frozen=True)
class PlanInput:
    """What ``atoll plan`` is asked about (see the module docstring for the model)."""

    params: int
    bandwidth_gbit: float
    step_seconds: float
    codec: str = "int8"
    block_size: int = 256
    topk_k: int = 0
    """With codec ``topk``: values kept per chunk of ``block_size``."""
    topk_bits: int = 0
    """With codec ``topk``: bits per kept value."""
    fragments: int = 1
    group_size: int = 2
    trigger: Literal["steps", "seconds"] = "steps"
    inner_steps: int = 50
    round_seconds: float | None = None
    tau: int = 0
    distance_km: float = 0.0
    round_trips: int = 2
    overhead_seconds: float = 0.0

    def __post_init__(self) -> None:
        checks = [
            (self.params >= 1, "params must be >= 1"),
            (self.bandwidth_gbit > 0, "bandwidth must be > 0"),
            (self.step_seconds > 0, "step seconds must be > 0"),
            (self.fragments >= 1, "fragments must be >= 1"),
            (self.group_size >= 2, "a group has at least 2 members"),
            (self.trigger in ("steps", "seconds"), "trigger is steps or seconds"),
            (self.inner_steps >= 1, "inner steps must be >= 1"),
            (self.round_seconds is None or self.round_seconds > 0, "round seconds must be > 0"),
            (self.tau >= 0, "tau must be >= 0"),
            (self.distance_km >= 0, "distance must be >= 0"),
            (self.round_trips >= 0, "round trips must be >= 0"),
            (self.overhead_seconds >= 0, "overhead seconds must be >= 0"),
        ]
        for ok, problem in checks:
            if not ok:
                raise ValueError(problem)


def plan(inp: PlanInput) -> dict[str, Any]:
    """Bytes, time on the link, overlap and utilization of a run's syncs.

    Raises:
        ValueError: an unknown codec or a bad block size.
    """
    from protocol.wire.codec import encoded_size, sparse_result_bound

    values = -(-inp.params // inp.fragments)
    sparse = {"k": inp.topk_k, "bits": inp.topk_bits} if inp.codec == "topk" else {}
    fragment_bytes = encoded_size(values, inp.codec, inp.block_size, **sparse)
    share = (inp.group_size - 1) / inp.group_size
    if sparse:
        # results are the union of the members' kept values, 8 bits each: at most
        # group_size times as many values as one part keeps
        result_bytes = sparse_result_bound(values, inp.block_size, inp.topk_k, inp.group_size)
    else:
        result_bytes = fragment_bytes
    sent_per_sync = share * (fragment_bytes + result_bytes)
    one_way = inp.distance_km * ONE_WAY_SECONDS_PER_KM
    transfer = sent_per_sync * 8 / (inp.bandwidth_gbit * 1e9)
    sync = transfer + inp.round_trips * 2 * one_way + inp.overhead_seconds
    out: dict[str, Any] = {
        "input": asdict(inp),
        "fragment_values": values,
        "fragment_bytes": fragment_bytes,
        "full_sync_bytes": encoded_size(inp.params, inp.codec, inp.block_size, **sparse),
        "sent_bytes_per_sync": sent_per_sync,
        "sent_bytes_per_round": sent_per_sync * inp.fragments,
        "one_way_seconds": one_way,
        "transfer_seconds": transfer,
        "sync_seconds": sync,
    }
    out.update(_steps_timing(inp, sync) if inp.trigger == "steps" else _seconds_timing(inp, sync))
    return out


def _steps_timing(inp: PlanInput, sync: float) -> dict[str, Any]:
    """A round of H inner steps: F syncs, each hidden behind tau steps or waited on."""
    compute = inp.inner_steps * inp.step_seconds
    hidden = inp.tau * inp.step_seconds
    wait = max(0.0, sync - hidden)
    utilization = compute / (compute + inp.fragments * wait)
    if wait == 0:
        smallest = 1
    else:  # H s / (H s + F wait) >= u  <=>  H >= u F wait / ((1 - u) s)
        target = TARGET_UTILIZATION
        need = target * inp.fragments * wait / ((1 - target) * inp.step_seconds)
        smallest = max(1, math.ceil(need - 1e-9))
    return {
        "round_seconds": compute + inp.fragments * wait,
        "overlap": min(1.0, hidden / sync) if sync > 0 else 1.0,
        "wait_seconds_per_sync": wait,
        "utilization": utilization,
        "fits": True,
        "smallest_inner_steps": smallest,
    }


def _seconds_timing(inp: PlanInput, sync: float) -> dict[str, Any]:
    """A round of fixed wall time: a sync fits in it, with a margin, or fails."""
    round_seconds = inp.round_seconds or inp.inner_steps * inp.step_seconds
    budget = round_seconds * (1 - _MARGIN)
    fits = sync <= budget
    smallest_round = sync / (1 - _MARGIN)
    return {
        "round_seconds": round_seconds,
        "overlap": 1.0 if fits else budget / sync,
        "wait_seconds_per_sync": 0.0,
        # nodes never wait on the wall clock; a sync that does not fit fails, and its
        # work waits for the next one (nothing is lost, but nothing is averaged)
        "utilization": 1.0 if fits else 0.0,
        "fits": fits,
        "smallest_round_seconds": smallest_round,
        "smallest_inner_steps": max(1, math.ceil(smallest_round / inp.step_seconds - 1e-9)),
    }


def describe(result: dict[str, Any]) -> str:
    """The plan as lines for a person."""
    inp = result["input"]

    def size(n: float) -> str:
        for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if n >= scale:
                return f"{n / scale:.3g} {unit}"
        return f"{n:.0f} B"

    lines = [
        f"model {inp['params']:,} parameters in {inp['fragments']} fragment(s), codec "
        f"{inp['codec']}: {size(result['fragment_bytes'])} a fragment, "
        f"{size(result['full_sync_bytes'])} a full sync",
        f"each node sends {size(result['sent_bytes_per_sync'])} per fragment sync "
        f"(group of {inp['group_size']}), {size(result['sent_bytes_per_round'])} per round",
        f"a sync takes {result['sync_seconds']:.3g} s on the link: "
        f"{result['transfer_seconds']:.3g} s at {inp['bandwidth_gbit']:g} Gbit/s, "
        f"{inp['round_trips']} round trip(s) of {2 * result['one_way_seconds'] * 1e3:.3g} ms "
        f"over {inp['distance_km']:g} km, {inp['overhead_seconds']:g} s fixed",
    ]
    if inp["trigger"] == "steps":
        lines.append(
            f"steps trigger, H = {inp['inner_steps']}, tau = {inp['tau']}: "
            f"{result['overlap']:.0%} of each sync hidden behind compute, "
            f"{result['wait_seconds_per_sync']:.3g} s waited per sync; utilization "
            f"{result['utilization']:.1%}"
        )
    else:
        verdict = "fits" if result["fits"] else "does NOT fit (syncs would fail)"
        lines.append(
            f"seconds trigger, rounds of {result['round_seconds']:.3g} s: each sync "
            f"{verdict}; nodes never wait; utilization {result['utilization']:.0%}"
        )
    lines.append(
        f"smallest H for utilization >= {TARGET_UTILIZATION:.0%}: "
        f"{result['smallest_inner_steps']} inner steps"
        + (
            f" (rounds of {result['smallest_round_seconds']:.3g} s)"
            if "smallest_round_seconds" in result
            else ""
        )
    )
    return "\n".join(lines)
