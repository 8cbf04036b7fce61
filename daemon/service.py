"""gRPC server of a node: dilocox.v1.Node, grpc.health.v1.Health and server reflection (grpc.aio).

Every handler is registered with a request parser that turns bytes that are not a valid request
message into INVALID_ARGUMENT and one WARNING line (grpc would answer UNKNOWN and log the parser's
traceback as an ERROR); the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import os
import secrets

import grpc
from dilocox.daemon.status import State
from dilocox.proto.dilocox.v1 import node_pb2, node_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name


def load_operator_token(path) -> str:
    """The operator token in ``path``, creating the file (mode 0600, 32 random bytes as hex) if it is missing.
    Raises OSError or ValueError (a file without a token of at least 16 characters)."""
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    token = open(path, encoding="utf-8").read().strip()
    if len(token) < 16:
        raise ValueError(f"operator token file {path} must hold a token of at least 16 characters")
    return token


class NodeService(node_pb2_grpc.NodeServicer):
    """``token``: the operator token (None: none configured, a loopback-only node); ``read_needs_token``:
    whether reads need it too. The token travels as gRPC metadata ``authorization: Bearer <token>``."""

    def __init__(self, node, token: str | None = None, read_needs_token: bool = False):
        self.node, self.token, self.read_needs_token = node, token, read_needs_token

    async def _authorize(self, context, changes: bool) -> None:
        if self.token is None or not (changes or self.read_needs_token):
            return
        sent = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
            logger.warning("refused %s from %s: no valid operator token", "a change" if changes else "a read",
                           context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs the operator token "
                                                                 "(dilocox-ctl --token-file)")

    async def GetStatus(self, request, context):
        await self._authorize(context, changes=False)
        return self.node.board.to_proto()

    async def WatchStatus(self, request, context):
        await self._authorize(context, changes=False)
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
        await self._authorize(context, changes=False)
        swarm = self.node.swarm
        if swarm is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node has not joined the swarm yet")
        members = await asyncio.get_running_loop().run_in_executor(None, swarm.members)
        peers = [node_pb2.PeerInfo(peer_id=m.peer_id, state=m.state, outer_step=m.outer_step, inner_step=m.inner_step,
                                   tokens_per_second=m.tokens_per_second, loss=m.loss,
                                   global_params_digest=m.global_params_digest, expires_in_s=ttl,
                                   client_mode=m.client_mode,
                                   undialable_by=sorted(o.peer_id for o, _ in members if m.peer_id in o.undialable))
                 for m, ttl in sorted(members, key=lambda item: item[0].peer_id)]
        return node_pb2.ListPeersResponse(peers=peers)

    async def Leave(self, request, context):
        await self._authorize(context, changes=True)
        self.node.request_leave(request.reason or "dilocox-ctl leave")
        return node_pb2.LeaveResponse(accepted=True, state=State.DRAINING.value)


class _Malformed:
    """What the request parser hands the handler for bytes that are not a valid request message."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(parse):
    def tolerant_parse(raw: bytes):
        try:
            return parse(raw)
        except Exception as e:  # protobuf's DecodeError, or whatever else these bytes make the parser raise
            return _Malformed(e)
    return tolerant_parse


async def _reject(context, method: str, request: _Malformed) -> None:
    reason = " ".join(f"{type(request.error).__name__}: {request.error}".split())
    logger.warning("malformed request to %s from %s rejected: %s", method, context.peer(), reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request to {method}: {reason}")


async def _checked_requests(requests, context, method: str):
    async for request in requests:
        if isinstance(request, _Malformed):
            await _reject(context, method, request)
        yield request


def _checked(handler, method: str):
    """``handler`` (a grpc.RpcMethodHandler of async behaviours) with the tolerant parser and the check."""
    if handler is None or handler.request_deserializer is None:
        return handler
    kwargs = dict(request_deserializer=_tolerant(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
    if handler.request_streaming:
        inner = handler.stream_stream or handler.stream_unary
        if inspect.isasyncgenfunction(inner):
            async def behaviour(requests, context):
                async for response in inner(_checked_requests(requests, context, method), context):
                    yield response
        else:
            async def behaviour(requests, context):
                return await inner(_checked_requests(requests, context, method), context)
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(behaviour, **kwargs)
        return grpc.stream_unary_rpc_method_handler(behaviour, **kwargs)
    inner = handler.unary_stream or handler.unary_unary
    if inspect.isasyncgenfunction(inner):
        async def behaviour(request, context):
            if isinstance(request, _Malformed):
                await _reject(context, method, request)
            async for response in inner(request, context):
                yield response
    else:  # a coroutine: returns the response, or writes the stream with context.write
        async def behaviour(request, context):
            if isinstance(request, _Malformed):
                await _reject(context, method, request)
            return await inner(request, context)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behaviour, **kwargs)


class _CheckedGenericHandler(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self.inner = inner

    def service(self, handler_call_details):
        return _checked(self.inner.service(handler_call_details), handler_call_details.method)


class _CheckedRegistry:
    """Stands in for the server while the generated ``add_*Servicer_to_server`` functions register their
    handlers, and passes them on with the tolerant parser."""

    def __init__(self, server: grpc.aio.Server):
        self.server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.server.add_generic_rpc_handlers(tuple(_CheckedGenericHandler(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.server.add_registered_method_handlers(
            service, {name: _checked(h, f"/{service}/{name}") for name, h in handlers.items()})


class PortInUseError(OSError):
    """The status address could not be bound."""


async def start_server(node, address: str, token: str | None = None,
                       read_needs_token: bool = False) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Bind and start; raises PortInUseError naming the address if it cannot be bound."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    registry = _CheckedRegistry(server)
    node_pb2_grpc.add_NodeServicer_to_server(NodeService(node, token, read_needs_token), registry)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registry)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(  # what enable_server_reflection does for grpc.aio
        reflection.aio.ReflectionServicer((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)), registry)
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
