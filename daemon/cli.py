"""Console script ``dilocox-node``: the daemon (see daemon/ctl.py for ``dilocox-ctl``).

Exit codes of dilocox-node: 0 after a clean leave or max_outer_steps, 1 on a runtime failure
(DHT, sync, a drain that overran its budget), 2 on bad input (config, flags, env, data, model, busy
status port, swarm settings that differ from most members': daemon/node.py), 130 on a second
Ctrl-C while draining (exit at once, no checkpoint).

Stopping: SIGTERM or SIGINT, to this process or to its whole process group, or ``dilocox-ctl leave``
drain the node; the hivemind children leave group-wide signals to us (peers/lifecycle.py) and
are shut down by the drain. Whatever is still running below us afterwards is ended before we
exit, so the process never waits forever on a child.
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
import time

# hivemind forks its DHT/averager processes after our gRPC server exists; they never use grpcio
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Memory (docs/operations.md, "Memory per node"); an operator's own values win. hivemind shares tensors with its
# averager through torch's file_system strategy by default, which starts a torch_shm_manager process (about 60 MB
# per node); file descriptors need none, and a node shares only a few tensors. p2pd (Go) inherits our
# environment: a lower GC target keeps its heap about 25 MB smaller for a little more GC work.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
os.environ.setdefault("GOGC", "50")


from dilocox.daemon.config import ConfigError, add_flags, load_config
from dilocox.daemon.logs import configure_logging, route_hivemind_logs, status_context
from dilocox.daemon.status import State, StatusBoard

import dilocox

logger = logging.getLogger(__name__)

# seconds the exit path (gRPC server stop, joins, interpreter exit) may take after the drain
EXIT_GRACE_S = 10.0


def node_main(argv: list[str] | None = None) -> int:
    """Returns the exit code on bad input; once the node has started, ends the process itself."""
    parser = argparse.ArgumentParser(prog="dilocox-node",
                                     description="Run a dilocox node (DiLoCo over a hivemind swarm).")
    parser.add_argument("--version", action="version", version=f"dilocox-node {dilocox.__version__}")
    add_flags(parser)
    flags = vars(parser.parse_args(argv))
    try:
        cfg = load_config(flags)
    except ConfigError as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        return 2
    from dilocox.data import DataError  # torch imports only after the config is known good
    from dilocox.model import ModelSpecError

    workload = None
    if cfg.local_epochs is not None:
        try:
            cfg, workload = resolve_local_epochs(cfg)
        except (DataError, ModelSpecError, ValueError) as e:
            print(f"dilocox-node: {e}", file=sys.stderr)
            return 2
    from dilocox import threads

    threads.single_threaded_default()  # before the first torch op: torch's CPU threads go to training (threads.py)
    board = StatusBoard(run_id=cfg.run_id, version=dilocox.__version__, inner_steps=cfg.inner_steps,
                        swarm_settings=cfg.swarm_settings())
    configure_logging(cfg.log_level, cfg.log_format, status_context(board) if cfg.log_format == "json" else None)

    from dilocox.daemon.metrics import check_metrics_addr
    from dilocox.daemon.node import Node
    from dilocox.daemon.redteam import AttackError

    if cfg.log_format == "json":
        route_hivemind_logs()
    try:
        _check_port_free(cfg.status_addr)
        if cfg.metrics_addr:
            check_metrics_addr(cfg.metrics_addr)
        node = Node(cfg, board, workload)
    except (DataError, ModelSpecError, AttackError, _BadInput, OSError, ValueError) as e:  # OSError, ValueError:
        # a busy or malformed metrics address
        print(f"dilocox-node: {e}", file=sys.stderr)
        return 2
    from dilocox.peers.lifecycle import Descendants

    children = Descendants()
    stop = _StopSignals(node, children)
    stop.install()
    try:
        code = _run(node, cfg, stop)
    finally:
        children.end_all()
    _exit_now(code)


def resolve_local_epochs(cfg):
    """``--local-epochs E``: the config with H = the workload's ``steps_for_epochs(E)`` (every node of a swarm
    with the same data, partition, num_clients and batch size computes the same H), and the workload, loaded
    once for it and handed on to the Node. Raises DataError / ModelSpecError / ValueError naming the problem."""
    from dilocox.tokenizer import load_tokenizer
    from dilocox.workload import make_workload

    workload = make_workload(cfg.model, cfg.data, cfg.seq_len, cfg.batch_size, cfg.eval_batches, cfg.partition,
                             cfg.num_clients, cfg.seed, cfg.workload, load_tokenizer(cfg.tokenizer), cfg.text_field,
                             cfg.data_parts)
    steps = workload.steps_for_epochs(cfg.local_epochs)
    print(f"dilocox-node: --local-epochs {cfg.local_epochs:g}: H = {steps} inner steps per outer step",
          file=sys.stderr)
    return cfg.model_copy(update=dict(inner_steps=steps, local_epochs=None)), workload


def _exit_now(code: int) -> None:
    """End the process once the node and its children have ended, skipping the interpreter's finalization
    (seconds of garbage collection of torch's and hivemind's objects on a busy machine, and joins
    of worker threads that may be blocked on a DHT that is gone). Checkpoints and metrics are
    already closed; flush what is buffered."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run(node, cfg, stop: "_StopSignals") -> int:
    from dilocox.peers.identity import IdentityError
    from dilocox.peers.swarm import JoinError

    try:
        node.start()
    except (IdentityError, ValueError) as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        return 2
    except JoinError as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        return 0 if e.requested else 1  # a leave while the --join peers were busy is no failure
    except Exception as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        return 1
    finally:
        stop.children.remember()  # p2pd (a grandchild) too, while the DHT process is its parent
        stop.install()  # hivemind's averager set SIGINT to SIG_IGN here while it forked
    import uvloop

    try:
        return uvloop.run(_serve(node, cfg.status_addr, stop))
    except _BadInput as e:
        print(f"dilocox-node: {e}", file=sys.stderr)
        node.request_leave("status server failed")
        node.finished.wait(node.cfg.averaging_timeout)
        return 2


class _StopSignals:
    """SIGTERM and SIGINT drain the node; a second SIGINT while draining exits at once (code 130)
    after killing every process below us. Installed with signal.signal (not the event loop's
    handlers, which asyncio resets to SIG_DFL when the loop closes, before our children are ended)."""

    def __init__(self, node, children):
        self.node, self.children = node, children
        self.exit_armed = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self)

    def __call__(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.node.leave_requested.is_set():
            logger.warning("second SIGINT while draining: exiting now, without a checkpoint")
            self.children.kill_all()
            os._exit(130)
        self.node.request_leave(name)

    def arm_exit_deadline(self, seconds: float) -> None:
        """From now on, the process exits within ``seconds`` whatever hangs (a gRPC handler thread, an
        interpreter exit handler): a daemon thread ends our children and exits with the node's code."""
        if self.exit_armed:
            return
        self.exit_armed = True

        def expire():
            time.sleep(seconds)
            logger.error("still running %.0fs after the drain: ending our processes and exiting", seconds)
            self.children.kill_all()
            os._exit(self.node.exit_code)

        threading.Thread(target=expire, name="exit-deadline", daemon=True).start()


class _BadInput(Exception):
    pass


def _check_port_free(address: str) -> None:
    """Fail fast, before joining the swarm, if the status port is taken (the real bind comes later)."""
    if address.startswith("unix:"):
        _check_socket_free(address)
        return
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


def _check_socket_free(address: str) -> None:
    """``unix:PATH``: its directory must exist and no process may answer on it (a stale file is replaced:
    gRPC unlinks it before binding)."""
    path = address[len("unix:"):]
    if not os.path.isdir(os.path.dirname(path) or "."):
        raise _BadInput(f"status address {address}: no directory {os.path.dirname(path)!r}")
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return  # nobody listens: a file left by a process that died
    raise _BadInput(f"status address {address} is in use by a running process")


def drain_budget_s(cfg) -> float:
    """How long a drain may take: an in-flight all-reduce (averaging_timeout), then checkpoint,
    last membership record and child shutdowns."""
    return cfg.averaging_timeout + 10.0


async def _serve(node, status_addr: str, stop: _StopSignals) -> int:
    from dilocox.daemon.metrics import stop_metrics_server
    from dilocox.daemon.service import PortInUseError, load_operator_token, set_health, start_server

    cfg = node.cfg
    try:
        token = load_operator_token(cfg.operator_token_file) if cfg.operator_token_file else None
        server, port, health_servicer = await start_server(node, status_addr, token, cfg.status_read == "token")
    except (PortInUseError, OSError, ValueError) as e:
        raise _BadInput(str(e)) from e
    await set_health(health_servicer, False)
    shown = status_addr if status_addr.startswith("unix:") else f"{status_addr.rsplit(':', 1)[0]}:{port}"
    print(f"status: dilocox-ctl --addr {shown} status", flush=True)
    metrics = None
    if cfg.metrics_addr:  # after node.start(): hivemind's forked processes must not inherit its socket
        from dilocox.daemon.metrics import start_metrics_server

        try:
            metrics, mport = start_metrics_server(node.board, cfg.metrics_addr, node.workload.samples_per_step)
        except (OSError, ValueError) as e:
            await server.stop(None)
            raise _BadInput(str(e)) from e
        print(f"metrics: http://{cfg.metrics_addr.rsplit(':', 1)[0]}:{mport}/metrics", flush=True)

    thread = threading.Thread(target=node.run, name="training", daemon=True)
    thread.start()
    serving, drain_deadline = False, None
    while not node.finished.is_set():
        if drain_deadline is None and node.leave_requested.is_set():
            drain_deadline = time.monotonic() + drain_budget_s(node.cfg)
            stop.children.remember()
        elif drain_deadline is not None and time.monotonic() > drain_deadline:
            logger.error("drain did not finish within %.0fs: ending the node's processes", drain_budget_s(node.cfg))
            node.exit_code = 1
            break
        state = node.board.snapshot().state
        want = state in (State.SYNCING, State.TRAINING, State.AVERAGING)
        if want != serving:
            await set_health(health_servicer, want)
            serving = want
        await asyncio.sleep(0.1)
    stop.arm_exit_deadline(EXIT_GRACE_S)
    await set_health(health_servicer, False)
    await server.stop(grace=1.0)
    if metrics is not None:
        await asyncio.to_thread(stop_metrics_server, metrics)
    return node.exit_code


if __name__ == "__main__":
    sys.exit(node_main())
