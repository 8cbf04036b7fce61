"""Console script ``dilocox-node``: the daemon (see daemon/ctl.py for ``dilocox-ctl``).

Exit codes of dilocox-node: 0 after a clean leave or max_outer_steps, 1 on a runtime failure
(DHT, sync), 2 on bad input (config, flags, env, data, model, busy status port).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading

# hivemind forks its DHT/averager processes after our gRPC server exists; they never use grpcio
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


import dilocox
from daemon.config import ConfigError, add_flags, load_config
from daemon.status import State, StatusBoard

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


if __name__ == "__main__":
    sys.exit(node_main())
