"""Malformed gRPC requests to a real status server: INVALID_ARGUMENT, one WARNING line each, no
traceback, and the server keeps serving."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from daemon.service import start_server
from daemon.status import StatusBoard
from proto.dilocox.v1 import node_pb2, node_pb2_grpc

# bytes that parse as no protobuf message: a truncated varint tag, a truncated length, field number 0,
# wire type 7, a length past the end, a truncated fixed64
GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\xff", b"\x00", b"\x0f", b"\x0a\x05ab", b"\x09\x01"]
UNARY = ["/dilocox.v1.Node/GetStatus", "/dilocox.v1.Node/ListPeers", "/dilocox.v1.Node/Leave",
         "/grpc.health.v1.Health/Check"]
STREAM = ["/dilocox.v1.Node/WatchStatus", "/grpc.health.v1.Health/Watch"]
BIDI = ["/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"]
REJECTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)


class FakeSwarm:
    def members(self):
        return []


class FakeNode:
    def __init__(self):
        self.board = StatusBoard(run_id="bad-input", version="test", inner_steps=5)
        self.swarm = FakeSwarm()
        self.leave_reasons: list[str] = []

    def request_leave(self, reason: str = "requested") -> None:
        self.leave_reasons.append(reason)


async def _unary(channel, method: str, payload: bytes) -> grpc.StatusCode:
    try:
        await channel.unary_unary(method, request_serializer=None, response_deserializer=None)(payload, timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _stream(channel, method: str, payload: bytes) -> grpc.StatusCode:
    call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(payload, timeout=5)
    try:
        async for _ in call:
            call.cancel()  # a response means the garbage was accepted
            return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    return await call.code()


async def _bidi(channel, method: str, payload: bytes) -> grpc.StatusCode:
    call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)(timeout=5)
    try:
        await call.write(payload)
        await call.done_writing()
        async for _ in call:
            call.cancel()
            return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    return await call.code()


async def _well_formed(channel) -> dict:
    """One well-formed call of each kind, after the garbage."""
    stub = node_pb2_grpc.NodeStub(channel)
    watch = stub.WatchStatus(node_pb2.WatchStatusRequest(interval_s=0.1), timeout=5)
    first = await watch.read()
    watch.cancel()
    reflection_call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
    await reflection_call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    listed = await reflection_call.read()
    await reflection_call.done_writing()
    return dict(
        status=await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5),
        peers=await stub.ListPeers(node_pb2.ListPeersRequest(), timeout=5),
        watched=first,
        health=await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5),
        services=sorted(s.name for s in listed.list_services_response.service),
    )


async def _exercise(node: FakeNode):
    server, port, _ = await start_server(node, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            codes = {}
            for payload in GARBAGE:
                for method in UNARY:
                    codes[method, payload] = await _unary(channel, method, payload)
                for method in STREAM:
                    codes[method, payload] = await _stream(channel, method, payload)
                for method in BIDI:
                    codes[method, payload] = await _bidi(channel, method, payload)
            # a proto3 string that is not UTF-8 only fails for the message that has a string field
            codes["/dilocox.v1.Node/Leave", b"\x0a\x02\xff\xfe"] = await _unary(
                channel, "/dilocox.v1.Node/Leave", b"\x0a\x02\xff\xfe")
            served = await _well_formed(channel)
        return codes, served
    finally:
        await server.stop(grace=None)


def test_malformed_requests_are_rejected_and_logged_once(caplog):
    caplog.set_level(logging.DEBUG)
    node = FakeNode()
    codes, served = asyncio.run(_exercise(node))

    accepted = {k: c for k, c in codes.items() if c not in REJECTED}
    assert not accepted, f"malformed requests not rejected as INVALID_ARGUMENT/INTERNAL: {accepted}"
    # still serving well-formed requests
    assert served["status"].run_id == "bad-input" and served["watched"].run_id == "bad-input"
    assert list(served["peers"].peers) == []
    assert served["health"].status == health_pb2.HealthCheckResponse.SERVING
    assert "dilocox.v1.Node" in served["services"]
    assert node.leave_reasons == [], "a malformed Leave must not drain the node"

    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, "\n".join(f"{r.name} {r.levelname}: {r.getMessage()}" for r in errors)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(codes), (len(codes), [r.getMessage() for r in warnings])
    assert all("\n" not in r.getMessage() for r in warnings)
    mentioned = {m for m, _ in codes if any(m in r.getMessage() for r in warnings)}
    assert mentioned == {m for m, _ in codes}, "each warning names the method"


@pytest.mark.parametrize("payload", [b"", b"\x08\x01"])
def test_well_formed_or_unknown_fields_still_served(payload):
    """An empty request and one with an unknown field are valid protobuf: served, not rejected."""
    async def go():
        server, port, _ = await start_server(FakeNode(), "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await _unary(channel, "/dilocox.v1.Node/GetStatus", payload)
        finally:
            await server.stop(grace=None)

    assert asyncio.run(go()) == grpc.StatusCode.OK
