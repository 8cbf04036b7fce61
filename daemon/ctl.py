"""Console script ``dilocox-ctl``: query or control a running node over gRPC (dilocox.v1.Node), and manage swarm
admission files without contacting any node (``peer-id``, ``authority init|issue|revoke``; peers/admission.py).

``--json`` prints exactly one JSON value on stdout (an object for status, an array for peers).
Exit codes: 0 ok, 1 the node could not be reached or answered an error (``health``: or is not SERVING),
2 bad arguments, or (admission commands) a key, certificate, peer id or file problem, told on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from dilocox.daemon import datactl
from dilocox.proto.dilocox.v1 import node_pb2, node_pb2_grpc
from google.protobuf.json_format import MessageToDict

import dilocox


def _print_status(status: node_pb2.NodeStatus) -> None:
    r = status.last_round
    lines = [
        ("peer_id", status.peer_id), ("run_id", status.run_id), ("state", status.state),
        ("listen", ", ".join(status.listen_maddrs)), ("reachability", status.reachability),
        ("outer_step", status.outer_step),
        ("inner_step", f"{status.inner_step}/{status.inner_steps}"), ("loss", f"{status.loss:.4f}"),
        ("val_loss", f"{status.val_loss:.4f}"), ("tokens/s", f"{status.tokens_per_second:.0f}"),
        ("tokens_total", status.tokens_total), ("bytes sent/recv", f"{status.bytes_sent} / {status.bytes_received}"),
        ("last round", f"step {r.outer_step} group {r.group_size} {r.outcome} compute {r.compute_s:.2f}s "
                       f"comm {r.duration_s:.2f}s (blocked {r.wait_s:.2f}s) payload {r.payload_bytes} B"
                       + (" (an outsized contribution: SCAFFOLD's quiet restart counts from here)" if r.outsized
                          else "")),
        ("compression", f"{status.compression}: rank {r.rank} bits {r.bits} ratio {r.compression_ratio:.1f}x "
                        f"error {r.compression_error:.2f}"),
        ("deadlines", status.deadlines or "(no round yet)"),
        ("swarm_settings", status.swarm_settings),
        ("utilization", f"{status.compute_utilization:.0%} compute ({status.overlap} overlap)"),
        ("stage", f"{status.stage_index}/{status.num_stages}" + (
            f" of replica {status.replica_id} ({', '.join(status.replica_members)})" if status.num_stages > 1 else "")),
        ("memory", f"{status.memory.total_bytes / 2**20:.1f} MiB: params {status.memory.params_bytes / 2**20:.1f}, "
                   f"inner opt {status.memory.inner_optimizer_bytes / 2**20:.1f}, "
                   f"outer {status.memory.outer_optimizer_bytes / 2**20:.1f}, "
                   f"error feedback {status.memory.error_feedback_bytes / 2**20:.1f}"),
        ("digest", status.global_params_digest), ("swarm_size", status.swarm_size),
        ("resyncs", status.resyncs), ("uptime_s", f"{status.uptime_s:.0f}"),
    ]
    if status.last_error:
        lines.append(("last_error", status.last_error))
    for k, v in lines:
        print(f"{k:>16}: {v}")


def _as_dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _admission_command(args: argparse.Namespace) -> int:
    """``peer-id`` and ``authority ...``: local files only. Imported lazily: hivemind is slow to import."""
    from dilocox.peers import admission
    from dilocox.peers.identity import IdentityError

    try:
        if args.command == "peer-id":
            print(admission.peer_id_of_identity(args.identity))
        elif args.authority_command == "init":
            print(admission.init_authority(args.dir))
        elif args.authority_command == "issue":
            cert = admission.issue_certificate(args.dir, args.peer_id, days=args.days, role=args.role)
            admission.write_certificate(cert, args.out)
            print(f"certified peer {cert['peer_id']} as {cert['role']} until {admission.iso_utc(cert['expires_at'])} "
                  f"(serial {cert['serial']}): {args.out}")
        elif args.authority_command == "revoke":
            revoked = admission.revoke(args.dir, args.peer_id)
            print(f"revoked peer {args.peer_id}: {args.dir}/{admission.REVOKED_FILE} serial {revoked['serial']}, "
                  f"{len(revoked['revoked'])} peer(s) revoked")
    except (admission.AdmissionError, IdentityError, OSError) as e:
        print(f"dilocox-ctl: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dilocox-ctl", description="Query or control a running dilocox node.")
    parser.add_argument("--version", action="version", version=f"dilocox-ctl {dilocox.__version__}")
    parser.add_argument("--addr", default="127.0.0.1:50051", help="node's status address HOST:PORT, or unix:/PATH")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the node")
    parser.add_argument("--token-file", default=os.environ.get("DILOCOX_OPERATOR_TOKEN_FILE"), metavar="PATH",
                        help="the node's operator token file (its --operator-token-file): needed by leave, and by "
                             "reads on a node with --status-read token")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("status", "show this node's status"), ("peers", "list live swarm members")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true", help="print one JSON value and nothing else")
    sub.add_parser("watch", help="stream status changes until the node stops")
    sub.add_parser("leave", help="ask the node to drain and exit")
    sub.add_parser("health", help="exit 0 if the node's grpc.health.v1 service says SERVING (for healthchecks)")
    p = sub.add_parser("peer-id", help="print the libp2p peer id of an identity key file (created if missing)")
    p.add_argument("--identity", required=True, metavar="KEY", help="identity file, as given to dilocox-node")
    p = sub.add_parser("authority", help="swarm admission: create an authority, certify or revoke peers")
    auth = p.add_subparsers(dest="authority_command", required=True, metavar="{init,issue,revoke}")
    p = auth.add_parser("init", help="write DIR/authority.key (0600) and DIR/authority.pub; print the .pub path")
    p.add_argument("dir", metavar="DIR")
    p = auth.add_parser("issue", help="sign a certificate for a peer id and write it to --out")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--peer-id", required=True, help="base58 libp2p peer id (dilocox-ctl peer-id)")
    p.add_argument("--days", type=float, default=365.0, help="validity in days from now (default 365)")
    p.add_argument("--role", default="peer", help="certified role (only 'peer' is accepted)")
    p.add_argument("--out", required=True, metavar="CERT", help="certificate file to write")
    p = auth.add_parser("revoke", help="add a peer id to DIR/revoked.json (re-signed, serial + 1)")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--peer-id", required=True, help="base58 libp2p peer id")
    p = sub.add_parser("plot", help="draw a node's metrics.jsonl (its --checkpoint-dir) per outer step into a PNG")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a node's checkpoint directory (holding metrics.jsonl)")
    p.add_argument("-o", "--out", required=True, metavar="FILE.png")
    datactl.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command in ("tokenizer", "data", "export"):  # offline: no node is contacted
        return datactl.run(args)
    if args.command in ("peer-id", "authority"):  # --addr is accepted but unused: no node is contacted
        return _admission_command(args)
    if args.command == "plot":
        from pathlib import Path

        from dilocox.daemon.plot import plot_run

        try:
            print(plot_run(Path(args.run_dir), Path(args.out)))
        except (ValueError, OSError) as e:
            print(f"dilocox-ctl: {e}", file=sys.stderr)
            return 2
        return 0

    try:
        token = open(args.token_file, encoding="utf-8").read().strip() if args.token_file else None
    except OSError as e:
        print(f"dilocox-ctl: cannot read the token file: {e}", file=sys.stderr)
        return 2
    auth = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(args.addr) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        try:
            if args.command == "status":
                status = stub.GetStatus(node_pb2.GetStatusRequest(), timeout=args.timeout, metadata=auth)
                print(json.dumps(_as_dict(status))) if args.json else _print_status(status)
            elif args.command == "peers":
                peers = stub.ListPeers(node_pb2.ListPeersRequest(), timeout=args.timeout, metadata=auth).peers
                if args.json:
                    print(json.dumps([_as_dict(p) for p in peers]))
                for p in peers if not args.json else []:
                    reach = "client" if p.client_mode else (
                        f"undialable by {len(p.undialable_by)}" if p.undialable_by else "reachable")
                    print(f"{p.peer_id}  {p.state:<9} outer {p.outer_step:<5} inner {p.inner_step:<5} "
                          f"loss {p.loss:.3f}  {p.tokens_per_second:.0f} tok/s  {reach:<16} "
                          f"digest {p.global_params_digest}")
            elif args.command == "watch":
                for status in stub.WatchStatus(node_pb2.WatchStatusRequest(interval_s=1.0), metadata=auth):
                    print(f"{status.state:<9} outer {status.outer_step} inner {status.inner_step}/{status.inner_steps} "
                          f"loss {status.loss:.4f} val {status.val_loss:.4f} {status.tokens_per_second:.0f} tok/s "
                          f"group {status.last_round.group_size}", flush=True)
            elif args.command == "health":
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
                print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
            elif args.command == "leave":
                reply = stub.Leave(node_pb2.LeaveRequest(reason="dilocox-ctl leave"), timeout=args.timeout,
                                    metadata=auth)
                print(f"leave accepted: {reply.accepted} ({reply.state})")
        except grpc.RpcError as e:
            print(f"dilocox-ctl: {args.addr}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
