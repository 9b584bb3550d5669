"""Summaries of the scale benchmark (``scale.json``): its summary row, its real
swarms' per-node load and its simulated swarms, as the docs show them."""

from __future__ import annotations

from typing import Any

from benchmarks._formats import kb, markdown_table, mb, pct, sig, signed

__all__ = ["scale_load_table", "scale_row", "scale_simulated_table"]


def scale_row(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The scale benchmark's summary row: real swarms, the checks, the simulator."""
    real, cal = d["real"], d["calibration"]
    sizes = sorted(real, key=int)
    top = real[sizes[-1]]
    load = d["load_table"]

    def per(n: str, key: str, fmt: str) -> str:
        return format(load[n][key], fmt)

    link, cell = cal["link_check"], cal["cell_check"]
    link_err = " and ".join(
        f"{signed(v['error'] * 100)} % ({n} nodes)" for n, v in link["sizes"].items()
    )
    sim = d["simulated"]["node"]
    ns = sorted(sim, key=int)
    first, last = sim[ns[0]], sim[ns[-1]]
    big = [n for n in ns if int(n) >= 1024]
    hot = f"{sim[big[0]]['control']['dht_hotspot_bytes_per_round'] / 1e6:.1f} → " if big else ""
    result = (
        f"real: {top['syncs_complete']} / {top['syncs']} syncs complete at {sizes[-1]} nodes, "
        f"{sum(real[n]['mix']['windows_mixed'] for n in sizes)} of "
        f"{sum(real[n]['mix']['windows'] for n in sizes)} butterfly windows mixed, bits/byte "
        f"{top['val_bpb_start']:.2f} → {top['val_bpb_end']:.2f}; per node and round control "
        f"messages {' / '.join(per(n, 'control_messages_per_round', '.0f') for n in sizes)} and DHT "
        f"operations {' / '.join(per(n, 'dht_ops_per_round', '.1f') for n in sizes)} "
        f"(n = {' / '.join(sizes)}); model round within "
        f"{' / '.join(signed(cal['sizes'][n]['error'] * 100) for n in sizes)} % of the real one; "
        f"link-bound: simulator {link_err} of the real round; cell grid on {cell['nodes']} real "
        f"nodes: {cell['syncs_complete'].replace('/', ' / ')} syncs, reach of fragment 0 after "
        f"{cell['window']} rounds {pct(cell['real_reach_by_fragment']['0'])}, the simulator on "
        f"the same PeerIDs {pct(cell['sim_reach_share'])}. Simulated per node and round from "
        f"{ns[0]} to {int(ns[-1]):,} nodes: control CPU "
        f"{first['control']['control_cpu_s_per_node_round']:.0f} → "
        f"{last['control']['control_cpu_s_per_node_round']:.0f} s, commitments received "
        f"{first['control']['commit_messages_per_node_round']} → "
        f"{last['control']['commit_messages_per_node_round']}, DHT bytes "
        f"{mb(first['control']['dht_bytes_per_node_round'], 2)} → "
        f"{mb(last['control']['dht_bytes_per_node_round'], 2)}; busiest DHT node "
        f"{hot}{last['control']['dht_hotspot_bytes_per_round'] / 1e6:.1f} MB"
        + (f" from {int(big[0]):,} to {int(ns[-1]):,} nodes" if big else "")
        + f"; utilization {first['utilization'] * 100:.1f} → {pct(last['utilization'])}, "
        f"contributions in a result {first['included_share'] * 100:.0f} → "
        f"{pct(last['included_share'])}"
    )
    what = (
        f"scale: real swarms of {', '.join(sizes)} nodes (groups of {top['group_size']}, "
        f"{top['rounds']} rounds), the same at {' and '.join(link['sizes'])} nodes on "
        f"{link['uplink_mbit']:g} Mbit/s, {link['one_way_ms']:g} ms uplinks, {cell['nodes']} "
        f"nodes on the cell grid (groups of {cell['group_size']}), then the calibrated simulator "
        f"for {ns[0]} to {int(ns[-1]):,} nodes"
    )
    target = "per-node control and DHT load at most log n; simulator within 20 % of real rounds"
    return [(what, result, target)]


def scale_load_table(data: dict[str, Any]) -> str:
    """The scale benchmark's per-node load on real swarms, as a Markdown table."""
    header = [
        "nodes", "DHT ops", "DHT bytes (node's / DHT process I/O)", "DHT CPU",
        "control msgs", "sidecar I/O", "sidecar CPU", "p2pd CPU", "syncs complete",
    ]  # fmt: skip
    body = []
    for n, r in sorted(data["load_table"].items(), key=lambda kv: int(kv[0])):
        body.append(
            [
                n,
                f"{r['dht_ops_per_round']:.1f}",
                f"{kb(r['dht_payload_bytes_per_round'])} / {mb(r['dht_bytes_per_round'], 2)}",
                f"{r['dht_cpu_s_per_round']:.2f} s",
                f"{r['control_messages_per_round']:.0f}",
                kb(r["control_bytes_per_round"]),
                f"{r['control_cpu_s_per_round']:.2f} s",
                f"{r['p2pd_cpu_s_per_round']:.2f} s",
                r["syncs_complete"].replace("/", " / "),
            ]
        )
    return markdown_table(header, body)


def scale_simulated_table(data: dict[str, Any]) -> str:
    """The scale benchmark's simulated swarms on the default WAN, as a Markdown table:
    today's node, and the node without pacing (``before``) and with sampling
    (``sampled``) for comparison."""
    sim = data["simulated"]
    before, node, sampled = sim["before"], sim["node"], sim["sampled"]
    header = [
        "nodes", "round", "utilization", "bytes sent", "contributions in a result",
        f"reach after {data['sim_rounds']} rounds", "control CPU: before / node / sampled",
        "commitments received: before / node", "DHT bytes: before / node / sampled",
        "busiest DHT node serves: before / node",
    ]  # fmt: skip
    body = []
    for n in sorted(node, key=int):
        r = node[n]

        def c(policy: dict[str, Any], key: str, n: str = n) -> float:
            return policy[n]["control"][key]

        body.append(
            [
                f"{int(n):,}",
                f"{r['round_seconds_mean']:.0f} s",
                pct(r["utilization"]),
                mb(r["bytes_sent_per_node_round"]),
                pct(r["included_share"]) if r["included_share"] < 1 else "100 %",
                f"{sig(r['reach_share'] * 100)} %",
                " / ".join(
                    f"{c(p, 'control_cpu_s_per_node_round'):,.0f}" for p in (before, node, sampled)
                )
                + " s",
                " / ".join(
                    f"{c(p, 'commit_messages_per_node_round'):,.0f}" for p in (before, node)
                ),
                " / ".join(
                    sig(c(p, "dht_bytes_per_node_round") / 1e6) for p in (before, node, sampled)
                )
                + " MB",
                " / ".join(sig(c(p, "dht_hotspot_bytes_per_round") / 1e6) for p in (before, node))
                + " MB",
            ]
        )
    return markdown_table(header, body)
