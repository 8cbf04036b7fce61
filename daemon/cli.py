"""Console scripts: ``dilocox-node`` (the daemon) and ``dilocox-ctl`` (operator client).

Exit codes of dilocox-node: 0 after a clean leave or max_outer_steps, 1 on a runtime failure
(DHT, sync), 2 on bad input (config, flags, env, data, model, busy status port).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading

# hivemind forks its DHT/averager processes after our gRPC server exists; they never use grpcio
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc
from google.protobuf.json_format import MessageToDict

import dilocox
from daemon.config import ConfigError, add_flags, load_config
from daemon.status import State, StatusBoard
from proto.dilocox.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger("dilocox")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def node_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dilocox-node", description="Run a dilocox node (DiLoCo over a hivemind swarm).")
    add_flags(parser)
    flags = vars(parser.parse_args(argv))
    try:
        cfg = load_config(flags)
    except ConfigError as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        return 2
    _setup_logging(cfg.log_level)

    from daemon.node import Node  # torch/hivemind imports only after the config is known good
    from dilocox.data import DataError
    from dilocox.model import ModelSpecError

    from peers.identity import IdentityError

    board = StatusBoard(run_id=cfg.run_id, version=dilocox.__version__, inner_steps=cfg.inner_steps)
    try:
        _check_port_free(cfg.status_addr)
        node = Node(cfg, board)
    except (DataError, ModelSpecError, _BadInput) as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        return 2
    leave_on_signal = lambda signum, frame: node.request_leave(signal.Signals(signum).name)  # noqa: E731
    signal.signal(signal.SIGTERM, leave_on_signal)
    try:
        node.start()
    except (IdentityError, ValueError) as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        return 1
    import uvloop

    try:
        return uvloop.run(_serve(node, cfg.status_addr))
    except _BadInput as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        node.request_leave("status server failed")
        node.finished.wait(node.cfg.averaging_timeout)
        return 2


class _BadInput(Exception):
    pass


def _check_port_free(address: str) -> None:
    """Fail fast, before joining the swarm, if the status port is taken (the real bind comes later)."""
    host, port = address.rsplit(":", 1)
    if int(port) == 0:
        return
    if int(port) > 65535:
        raise _BadInput(f"status address {address}: port must be 0-65535")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise _BadInput(f"status address {address}: cannot resolve {host!r} ({e.strerror})") from e
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as e:
            raise _BadInput(f"status address {address} is not available: {e.strerror}") from e


async def _serve(node, status_addr: str) -> int:
    from daemon.service import PortInUseError, set_health, start_server

    try:
        server, port, health_servicer = await start_server(node, status_addr)
    except PortInUseError as e:
        raise _BadInput(str(e)) from e
    await set_health(health_servicer, False)
    host = status_addr.rsplit(":", 1)[0]
    print(f"status: dilocox-ctl --addr {host}:{port} status", flush=True)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.request_leave, signal.Signals(sig).name)
    thread = threading.Thread(target=node.run, name="training", daemon=True)
    thread.start()
    serving = False
    while not node.finished.is_set():
        state = node.board.snapshot().state
        want = state in (State.SYNCING, State.TRAINING, State.AVERAGING)
        if want != serving:
            await set_health(health_servicer, want)
            serving = want
        await asyncio.sleep(0.1)
    await set_health(health_servicer, False)
    await server.stop(grace=1.0)
    return node.exit_code


# ------------------------------------------------------------------ dilocox-ctl
def _print_status(status: node_pb2.NodeStatus) -> None:
    r = status.last_round
    lines = [
        ("peer_id", status.peer_id), ("run_id", status.run_id), ("state", status.state),
        ("listen", ", ".join(status.listen_maddrs)), ("outer_step", status.outer_step),
        ("inner_step", f"{status.inner_step}/{status.inner_steps}"), ("loss", f"{status.loss:.4f}"),
        ("val_loss", f"{status.val_loss:.4f}"), ("tokens/s", f"{status.tokens_per_second:.0f}"),
        ("tokens_total", status.tokens_total), ("bytes sent/recv", f"{status.bytes_sent} / {status.bytes_received}"),
        ("last round", f"step {r.outer_step} group {r.group_size} {r.outcome} compute {r.compute_s:.2f}s "
                       f"comm {r.duration_s:.2f}s payload {r.payload_bytes} B"),
        ("digest", status.global_params_digest), ("swarm_size", status.swarm_size),
        ("resyncs", status.resyncs), ("uptime_s", f"{status.uptime_s:.0f}"),
    ]
    if status.last_error:
        lines.append(("last_error", status.last_error))
    for k, v in lines:
        print(f"{k:>16}: {v}")


def _as_dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def ctl_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dilocox-ctl", description="Query or control a running dilocox node.")
    parser.add_argument("--addr", default="127.0.0.1:50051", help="node's status address HOST:PORT")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the node")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("status", "show this node's status"), ("peers", "list live swarm members")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true", help="print one JSON value and nothing else")
    sub.add_parser("watch", help="stream status changes until the node stops")
    sub.add_parser("leave", help="ask the node to drain and exit")
    args = parser.parse_args(argv)

    with grpc.insecure_channel(args.addr) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        try:
            if args.command == "status":
                status = stub.GetStatus(node_pb2.GetStatusRequest(), timeout=args.timeout)
                print(json.dumps(_as_dict(status))) if args.json else _print_status(status)
            elif args.command == "peers":
                peers = stub.ListPeers(node_pb2.ListPeersRequest(), timeout=args.timeout).peers
                if args.json:
                    print(json.dumps([_as_dict(p) for p in peers]))
                for p in peers if not args.json else []:
                    print(f"{p.peer_id}  {p.state:<9} outer {p.outer_step:<5} inner {p.inner_step:<5} "
                          f"loss {p.loss:.3f}  {p.tokens_per_second:.0f} tok/s  digest {p.global_params_digest}")
            elif args.command == "watch":
                for status in stub.WatchStatus(node_pb2.WatchStatusRequest(interval_s=1.0)):
                    print(f"{status.state:<9} outer {status.outer_step} inner {status.inner_step}/{status.inner_steps} "
                          f"loss {status.loss:.4f} val {status.val_loss:.4f} {status.tokens_per_second:.0f} tok/s "
                          f"group {status.last_round.group_size}", flush=True)
            elif args.command == "leave":
                reply = stub.Leave(node_pb2.LeaveRequest(reason="dilocox-ctl leave"), timeout=args.timeout)
                print(f"leave accepted: {reply.accepted} ({reply.state})")
        except grpc.RpcError as e:
            print(f"dilocox-ctl: {args.addr}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(node_main())
