"""The goodput benchmark's accounting of one node's tokens, from its events and status."""

from __future__ import annotations

from benchmarks.goodput import account, table_row

ME, OTHER = "12D3KooWme", "12D3KooWother"


def _sync(f: int, tokens: int, step: int, contributors: list[str]) -> dict:
    # one part per peer named, each reduced from every peer named but OTHER's own
    parts = [[p for p in contributors if p != OTHER or q == OTHER] for q in contributors]
    return {"event": "sync", "fragment": f, "tokens": tokens, "step": step,
            "contributors": parts}  # fmt: skip


def _failed(f: int, tokens: int, step: int) -> dict:
    return {"event": "sync_failed", "fragment": f, "tokens": tokens, "step": step}


def _end(tokens: int, *unsynced: int) -> dict:
    return {"event": "unsynced", "tokens": tokens, "fragments": list(unsynced)}


def test_a_failed_sync_counts_once_the_next_one_of_its_fragment_is_included() -> None:
    events = [_failed(0, 100, 10), _sync(0, 100, 20, [ME, OTHER]), _sync(1, 200, 20, [ME])]
    # ran to the end: 300 tokens, 100 of them after each fragment's last sync
    events.append(_end(300, 100, 100))
    got = account(events, {"peer_id": ME, "tokens": 290}, True, 2)
    assert got == {"trained": 400, "included": 400, "failed": 0, "dropped": 0}


def test_work_left_out_of_an_applied_result_or_never_folded_in_is_failed() -> None:
    events = [_sync(0, 100, 10, [OTHER]), _sync(0, 100, 20, [ME]), _failed(0, 100, 30)]
    got = account([*events, _end(300, 0)], {"peer_id": ME, "tokens": 300}, True, 1)
    assert got == {"trained": 300, "included": 100, "failed": 200, "dropped": 0}


def test_work_counts_in_the_share_of_parts_whose_result_holds_it() -> None:
    # four parts, this node's work in three of them
    parts = [[ME, OTHER], [ME, OTHER], [OTHER], [ME]]
    event = {"event": "sync", "fragment": 0, "tokens": 100, "step": 10, "contributors": parts}
    got = account([event, _end(100, 0)], {"peer_id": ME, "tokens": 100}, True, 1)
    assert got == {"trained": 100, "included": 75, "failed": 25, "dropped": 0}


def test_a_joiner_s_dropped_round_and_a_leaver_s_tail_are_in_no_sync() -> None:
    # a joiner trained 100 tokens while joining, dropped them, then synced 50 twice and
    # trained 50 more after its last sync
    events = [_sync(0, 50, 15, [ME]), _sync(0, 50, 20, [ME])]
    joiner = account([*events, _end(250, 50)], {"peer_id": ME, "tokens": 250}, True, 1)
    assert joiner == {"trained": 200, "included": 100, "failed": 0, "dropped": 100}
    # the same node killed instead: all it trained counts, the tail was lost
    leaver = account(events, {"peer_id": ME, "tokens": 250}, False, 1)
    assert leaver == {"trained": 250, "included": 100, "failed": 0, "dropped": 150}


def test_a_stopped_node_s_sync_that_ended_in_its_group_counts_as_included() -> None:
    left = {**_sync(0, 50, 20, [ME, OTHER]), "event": "sync_left"}
    events = [_sync(0, 50, 15, [ME]), left]
    leaver = account(events, {"peer_id": ME, "tokens": 120}, False, 1)
    assert leaver == {"trained": 120, "included": 100, "failed": 0, "dropped": 20}


def test_a_node_with_no_events_trained_what_its_status_says() -> None:
    got = account([], {"peer_id": ME, "tokens": 80}, True, 2)
    assert got == {"trained": 160, "included": 0, "failed": 0, "dropped": 160}


def test_the_table_row_names_every_churn_rate_and_an_error() -> None:
    report = {"nodes": 16, "rounds": 10, "round_seconds": 30.0, "rows": [
        {"churn": 0.0, "goodput": 0.991, "left": 0, "joined": 0},
        {"churn": 0.05, "goodput": 0.962, "left": 7, "joined": 8},
        {"churn": 0.1, "error": "TimeoutError: late"},
    ]}  # fmt: skip
    ((what, result, target),) = table_row(report)
    assert "16 real nodes" in what and "30 s" in what
    assert result == (
        "0 % churn: **99.1 %**; 5 % churn: **96.2 %** (7 left, 8 joined); 10 %: error"
    )
    assert "95 %" in target
