"""Receive buffers: reused only once nothing made of them is alive, within a budget."""

from __future__ import annotations

import asyncio

import pytest

from protocol.p2p._buffers import BufferPool, Lease


def test_a_small_body_gets_a_fresh_unpooled_buffer() -> None:
    pool = BufferPool(min_bytes=1024)
    lease = pool.lease(100)
    assert lease.data.nbytes == 100 and pool.allocated == 0
    lease.release()
    assert pool.idle_bytes == 0


def test_a_released_buffer_is_reused_for_a_body_of_similar_size() -> None:
    pool = BufferPool(min_bytes=1024)
    first = pool.lease(4096)
    first.data[:2] = b"hi"
    first.release()
    assert pool.idle_bytes == 4096
    second = pool.lease(3000)  # 4096 is within 3000 to 6000: reused, cut to size
    assert pool.allocated == 1 and second.data.nbytes == 3000
    third = pool.lease(10_000)  # too large for what is idle: a new one
    assert pool.allocated == 2
    second.release()
    third.release()


def test_a_buffer_still_viewed_is_not_handed_out_again() -> None:
    pool = BufferPool(min_bytes=1024)
    lease = pool.lease(4096)
    kept = lease.data[:10]  # a consumer keeps a view past the release
    lease.release()
    again = pool.lease(4096)
    assert pool.allocated == 2  # the viewed buffer stays idle, untouched
    kept.release()
    again.release()
    pool.lease(4096).release()
    assert pool.allocated == 2


def test_idle_buffers_are_kept_within_the_budget_largest_first() -> None:
    pool = BufferPool(max_free_bytes=10_000, min_bytes=1024)
    leases = [pool.lease(n) for n in (2048, 4096, 8192)]
    for lease in leases:
        lease.release()
    assert pool.idle_bytes == 8192  # 8192 + 4096 would pass the budget


def test_a_lease_handed_on_releases_the_buffer_once() -> None:
    pool = BufferPool(min_bytes=1024)
    lease = pool.lease(2048)
    with lease.handed_to("parsed message") as parsed:
        assert parsed.data == "parsed message" and lease.data == b""
        lease.release()  # the old lease holds nothing any more
        assert pool.idle_bytes == 0
    assert pool.idle_bytes == 2048
    Lease(b"plain").release()  # an unpooled lease releases to nothing


def test_a_request_is_read_into_a_pooled_buffer_and_an_early_end_gives_it_back() -> None:
    pool = BufferPool(min_bytes=1024)

    def reader(data: bytes) -> asyncio.StreamReader:
        r = asyncio.StreamReader()
        r.feed_data(data)
        r.feed_eof()
        return r

    async def read(data: bytes, length: int) -> Lease:
        return await pool.read_request(reader(data).read, length, "peer")

    lease = asyncio.run(read(b"x" * 2048, 2048))
    assert bytes(lease.data) == b"x" * 2048 and pool.allocated == 1
    lease.release()
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(read(b"x" * 100, 2048))
    assert pool.idle_bytes == 2048  # given back, not lost
