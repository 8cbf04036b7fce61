"""Volunteers behind NATs: one public node and NAT'd nodes behind routers of their own (tests/harness/netsim.py).

The NAT'd nodes reach the public node, not each other, so the all-gather must relay between them
(peers/allgather.py) and nobody may pick them as a state donor. ``run`` starts the public node,
two NAT'd nodes with ``--min-replicas 3`` and, with ``joiner``, a third NAT'd node once the others
have averaged a few rounds; it reports per outer step the group sizes and whether the nodes hold
equal parameters, in which of its own rounds the joiner first averaged (its first round is the one
after its start-up and state download), and the failed dials in the logs.

``--no-client-mode --auto-relay`` runs the NAT'd nodes as ordinary nodes that ask p2pd for a circuit
relay through the public node instead; the figures then include the relay addresses each announced.

    python -m bench.nat [--rounds 8] [--no-client-mode [--auto-relay]] [--no-joiner] [--out runs/bench/nat.json]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from tests.harness.localswarm import LocalNode, steps_of, wait_all, write_json
from tests.harness.netsim import NetSim

ARGS = ["--status-addr", "127.0.0.1:0", "--run-id", "nat", "--model", "tiny", "--inner-steps", "10",
        "--announce-period", "1", "--warmup-steps", "5", "--total-steps", "4000", "--eval-batches", "1",
        "--request-timeout", "1", "--matchmaking-time", "3", "--averaging-timeout", "10",
        "--outer-round-deadline", "40"]


def _start(net: NetSim, i: int, name: str, workdir: Path, extra: list[str]) -> LocalNode:
    args = ARGS + ["--listen", f"/ip4/{net.address(i)}/tcp/0"] + extra
    return LocalNode(name, workdir / name, args, wrapper=net.wrapper(i)).wait_started()


def _status(net: NetSim, i: int, node: LocalNode) -> dict:
    """The node's status over gRPC, asked from inside its namespace (dilocox-ctl status --json); {} if none."""
    done = net.run(i, [sys.executable, "-m", "dilocox.daemon.ctl", "--addr", node.addr, "status", "--json"], 30)
    try:
        return json.loads(done.stdout) if done.returncode == 0 else {}
    except ValueError:
        return {}


def run(workdir: Path, rounds: int = 8, client_mode: bool = True, joiner: bool = True, rate_mbit: float = 100,
        timeout_s: float = 300, prefix: str = "dlxn", auto_relay: bool = False) -> dict:
    """Run the NAT swarm; returns its figures (module docstring). Raises RuntimeError if a node exits; a wait
    longer than ``timeout_s`` ends the run and is reported in ``timed_out``."""
    nat = ["--client-mode"] if client_mode else (["--auto-relay"] if auto_relay else [])
    with NetSim(4 if joiner else 3, rate_mbit, prefix=prefix, nat=[1, 2, 3] if joiner else [1, 2]) as net:
        nodes: list[LocalNode] = []
        joined_at = joined_in = first_round = timed_out = None
        try:
            nodes.append(_start(net, 0, "public", workdir, ["--min-replicas", "3"]))
            join = ["--min-replicas", "3", "--join", nodes[0].join_maddr] + nat
            nodes += [_start(net, i, f"nat{i}", workdir, join) for i in (1, 2)]
            wait_all(nodes, lambda: all(len(n.metrics()) >= rounds for n in nodes), timeout_s, f"{rounds} rounds each")
            if joiner:
                joined_at = max(max(steps_of(n)) for n in nodes)  # outer steps already applied when it starts
                late = _start(net, 3, "nat3", workdir, ["--join", nodes[0].join_maddr] + nat)
                nodes.append(late)
                wait_all(nodes, lambda: any(r["outcome"] == "applied" and r["group_size"] >= 2
                                         for r in late.metrics()), timeout_s, "an averaged round of the joiner")
                rows = steps_of(late)
                first = min(s for s, r in rows.items() if r["outcome"] == "applied" and r["group_size"] >= 2)
                first_round = min(rows)  # its first round in the swarm (after start-up and state download)
                joined_in = first - first_round + 1
        except TimeoutError as e:  # reported with the figures (without client mode this is the expected outcome)
            timed_out = str(e).splitlines()[0]
        finally:
            steps = {}
            for node in nodes:
                for step, r in steps_of(node).items():
                    steps.setdefault(step, {})[node.name] = (r["outcome"], r["group_size"], r["digest"])
            logs = {n.name: n.err_path.read_text() for n in nodes}
            status = {n.name: _status(net, i, n) for i, n in enumerate(nodes)}
            reach = {name: s.get("reachability", "?") for name, s in status.items()}
            circuits = {name: [m for m in s.get("listen_maddrs", []) if "p2p-circuit" in m]
                        for name, s in status.items()}
            for n in nodes:
                n.terminate(signal.SIGKILL)
    table = []
    for step in sorted(steps):
        row = steps[step]
        table.append(dict(outer_step=step, nodes=len(row), group_sizes=sorted(g for _, g, _ in row.values()),
                          outcomes=sorted({o for o, _, _ in row.values()}),
                          equal_digests=len({d for _, _, d in row.values()}) == 1))
    return dict(client_mode=client_mode, auto_relay=auto_relay, rate_mbit=rate_mbit, timed_out=timed_out, steps=table,
                relay_addrs=circuits,
                joiner_started_after_step=joined_at, joiner_first_round=first_round,
                joiner_averaged_within_rounds=joined_in,
                failed_dials={name: log.count("failed to dial") for name, log in logs.items()},
                reachability=reach,
                relayed_rounds={name: log.count("via relay") for name, log in logs.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8, help="outer steps every first node must record")
    p.add_argument("--no-client-mode", dest="client_mode", action="store_false", help="NAT'd nodes without it")
    p.add_argument("--no-joiner", dest="joiner", action="store_false", help="no NAT'd joiner")
    p.add_argument("--auto-relay", action="store_true", help="with --no-client-mode: NAT'd nodes use --auto-relay")
    p.add_argument("--rate-mbit", type=float, default=100)
    p.add_argument("--timeout", type=float, default=300, help="seconds for each wait")
    p.add_argument("--out", type=Path, default=Path("runs/bench/nat.json"))
    a = p.parse_args(argv)
    ok, why = NetSim.nat_available()
    if not ok:
        raise SystemExit(f"bench.nat needs NAT'd namespaces: {why}")
    with tempfile.TemporaryDirectory(prefix="dilocox-nat-") as tmp:
        result = run(Path(tmp), a.rounds, a.client_mode, a.joiner, a.rate_mbit, a.timeout, auto_relay=a.auto_relay)
    write_json(a.out, result)
    for row in result["steps"]:
        print(f"outer step {row['outer_step']:>3}: groups {row['group_sizes']} {'/'.join(row['outcomes'])} "
              f"{'equal' if row['equal_digests'] else 'DIFFERENT'} digests")
    if result["timed_out"]:
        print(f"TIMED OUT: {result['timed_out']}")
    print(f"joiner started after outer step {result['joiner_started_after_step']}, trained from round "
          f"{result['joiner_first_round']} on and averaged in its round {result['joiner_averaged_within_rounds']}; "
          f"reachability {result['reachability']}; "
          f"failed dials in logs {result['failed_dials']}; relay addresses {result['relay_addrs']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
