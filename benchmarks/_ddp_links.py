"""Emulated links for the DDP baseline: DDP comm hooks that finish each bucket's gloo
all-reduce no earlier than a link of a given bandwidth and delay allows, or that only add
the ring's delays where gloo crosses a real, shaped link (:mod:`benchmarks._wan_netns`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from protocol.p2p.shaper import LinkShape

__all__ = ["ring_allreduce_seconds", "wrap_ddp"]


def ring_allreduce_seconds(nbytes: int, world: int, link: LinkShape) -> float:
    """Time a ring all-reduce of ``nbytes`` per rank takes on ``link``.

    Each rank sends ``2 (n - 1) / n`` of the vector in ``2 (n - 1)`` steps, and every
    step waits one one-way delay: ``2(n-1)/n * bytes * 8 / bandwidth + 2(n-1) * delay``.
    """
    if world < 2:
        return 0.0
    steps = 2 * (world - 1)
    return link.transfer_seconds(int(nbytes * steps / world)) + steps * link.delay_s


def wrap_ddp(model: Any, world: int, link: LinkShape | None = None, delay_s: float = 0.0) -> Any:
    """``model`` in DDP, behind the emulated ``link`` (:func:`_link_allreduce_hook`) or the
    ring's delays of ``delay_s`` (:func:`_delay_allreduce_hook`) where given; ``link`` wins."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    if link is not None:
        ddp.register_comm_hook(_LinkHookState(link, world), _link_allreduce_hook)
    elif delay_s > 0:
        ddp.register_comm_hook(_LinkHookState(LinkShape(delay_s), world), _delay_allreduce_hook)
    return ddp


class _LinkHookState:
    """The emulated link of one DDP rank: buckets queue on it one after another."""

    def __init__(self, link: LinkShape, world: int) -> None:
        self.link = link
        self.world = world
        self.free_at = 0.0
        self.lock = threading.Lock()

    def book(self, now: float, seconds: float) -> float:
        """Occupy the link for ``seconds`` from ``now`` or after earlier bookings; the end."""
        with self.lock:
            self.free_at = max(now, self.free_at) + seconds
            return self.free_at


def _hand_over(reduced, result) -> None:
    """Complete DDP's future ``result`` with gloo's all-reduce ``reduced``, or its failure."""
    try:
        result.set_result(reduced.value())
    except Exception as e:  # hand gloo's failure to DDP instead of losing it in a thread
        result.set_exception(e)


# DDP checks a hook's annotations against the real classes, and this module's annotations
# are strings (``from __future__ import annotations``): ``bucket`` and the return stay bare.
def _link_allreduce_hook(state: _LinkHookState, bucket):
    """DDP comm hook: gloo's all-reduce, finished no earlier than the emulated link allows.

    gloo's traffic cannot be shaped from here, so the bucket's future completes at
    ``max(gloo done, link free + ring time)``; the wait runs on a timer thread, so
    backward keeps computing the next buckets meanwhile, as it would on a real link.
    """
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buffer = bucket.buffer()
    cost = ring_allreduce_seconds(buffer.numel() * buffer.element_size(), state.world, state.link)
    done_at = state.book(time.monotonic(), cost)
    result: torch.futures.Future = torch.futures.Future()

    def finish(reduced: torch.futures.Future) -> None:
        remaining = done_at - time.monotonic()
        if remaining > 0:
            threading.Timer(remaining, _hand_over, args=(reduced, result)).start()
        else:
            _hand_over(reduced, result)

    default_hooks.allreduce_hook(None, bucket).add_done_callback(finish)
    return result


def _delay_allreduce_hook(state: _LinkHookState, bucket):
    """DDP comm hook: gloo's all-reduce, then the ring's ``2(n-1)`` one-way delays.

    For a link whose bandwidth gloo's sockets really cross (tbf in a network namespace),
    so the bandwidth term is measured and only the delay is modelled (the kernels these
    run on lack netem): the bucket's future completes ``2(n-1) * delay`` after gloo's,
    and after the delays of earlier buckets, as successive ring all-reduces' steps would.
    """
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    latency = ring_allreduce_seconds(0, state.world, state.link)  # 2(n-1) * delay
    result: torch.futures.Future = torch.futures.Future()

    def finish(reduced: torch.futures.Future) -> None:
        remaining = state.book(time.monotonic(), latency) - time.monotonic()
        threading.Timer(max(0.0, remaining), _hand_over, args=(reduced, result)).start()

    default_hooks.allreduce_hook(None, bucket).add_done_callback(finish)
    return result
