"""gRPC server of a node: dilocox.v1.Node, grpc.health.v1.Health and server reflection (grpc.aio)."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from daemon.status import State
from proto.dilocox.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger("dilocox.service")
SERVICE_NAME = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name


class NodeService(node_pb2_grpc.NodeServicer):
    def __init__(self, node):
        self.node = node

    async def GetStatus(self, request, context):
        return self.node.board.to_proto()

    async def WatchStatus(self, request, context):
        interval = request.interval_s if request.interval_s > 0 else 1.0
        if interval > 3600:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "interval_s must be at most 3600")
        board, loop = self.node.board, asyncio.get_running_loop()
        while True:
            version = board.version
            yield board.to_proto()
            if board.snapshot().state == State.STOPPED:
                return
            await loop.run_in_executor(None, board.wait_change, version, interval)

    async def ListPeers(self, request, context):
        swarm = self.node.swarm
        if swarm is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node has not joined the swarm yet")
        members = await asyncio.get_running_loop().run_in_executor(None, swarm.members)
        peers = [node_pb2.PeerInfo(peer_id=m.peer_id, state=m.state, outer_step=m.outer_step, inner_step=m.inner_step,
                                   tokens_per_second=m.tokens_per_second, loss=m.loss,
                                   global_params_digest=m.global_params_digest, expires_in_s=ttl)
                 for m, ttl in sorted(members, key=lambda item: item[0].peer_id)]
        return node_pb2.ListPeersResponse(peers=peers)

    async def Leave(self, request, context):
        self.node.request_leave(request.reason or "dilocox-ctl leave")
        return node_pb2.LeaveResponse(accepted=True, state=State.DRAINING.value)


class PortInUseError(OSError):
    """The status address could not be bound."""


async def start_server(node, address: str) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Bind and start; raises PortInUseError naming the address if it cannot be bound."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    node_pb2_grpc.add_NodeServicer_to_server(NodeService(node), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise PortInUseError(f"cannot bind status address {address}: {e}") from e
    if port == 0:
        raise PortInUseError(f"cannot bind status address {address} (in use or not a local address)")
    await server.start()
    return server, port, health_servicer


async def set_health(health_servicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)
