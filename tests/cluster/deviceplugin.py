"""A test device plugin for the real node: the kubelet's device-plugin API (gRPC, deviceplugin/v1beta1)
serving N Spyre cards under one extended resource (ibm.com/spyre_pf), the way IBM's Spyre device plugin
does. It registers on the kubelet's socket, lists its cards (ListAndWatch) and, on Allocate, hands each
container the environment that plugin sets: PCIDEVICE_<RESOURCE> = the comma-separated PCI addresses of the
cards the kubelet chose. The kubelet, not the test, decides which pod gets which cards.

The protobuf messages are built here from their field numbers in the public api.proto (no generated code,
no protoc): only the messages this plugin sends or reads. Test infrastructure, never shipped.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

API_VERSION = "v1beta1"
KUBELET_SOCKET_DIR = Path("/var/lib/kubelet/device-plugins")  # fixed in the 1.20 kubelet

_F = descriptor_pb2.FieldDescriptorProto
_STRING, _BOOL, _MSG = _F.TYPE_STRING, _F.TYPE_BOOL, _F.TYPE_MESSAGE
_ONE, _MANY = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
# name -> [(field, number, type, label, message type)]
_MESSAGES = {
    "Empty": [],
    "DevicePluginOptions": [
        ("pre_start_required", 1, _BOOL, _ONE, None),
        ("get_preferred_allocation_available", 2, _BOOL, _ONE, None),
    ],
    "RegisterRequest": [
        ("version", 1, _STRING, _ONE, None),
        ("endpoint", 2, _STRING, _ONE, None),
        ("resource_name", 3, _STRING, _ONE, None),
        ("options", 4, _MSG, _ONE, "DevicePluginOptions"),
    ],
    "Device": [("ID", 1, _STRING, _ONE, None), ("health", 2, _STRING, _ONE, None)],
    "ListAndWatchResponse": [("devices", 1, _MSG, _MANY, "Device")],
    "ContainerAllocateRequest": [("devicesIDs", 1, _STRING, _MANY, None)],
    "AllocateRequest": [("container_requests", 1, _MSG, _MANY, "ContainerAllocateRequest")],
    "StringMap": [("key", 1, _STRING, _ONE, None), ("value", 2, _STRING, _ONE, None)],
    "ContainerAllocateResponse": [
        ("envs", 1, _MSG, _MANY, "ContainerAllocateResponse.EnvsEntry"),
        ("annotations", 4, _MSG, _MANY, "ContainerAllocateResponse.AnnotationsEntry"),
    ],
    "AllocateResponse": [("container_responses", 1, _MSG, _MANY, "ContainerAllocateResponse")],
    "PreStartContainerRequest": [("devicesIDs", 1, _STRING, _MANY, None)],
    "PreStartContainerResponse": [],
}


def _build_messages() -> dict[str, type]:
    fdp = descriptor_pb2.FileDescriptorProto(name="spyre_test_deviceplugin.proto", package=API_VERSION)
    fdp.syntax = "proto3"
    for name, fields in _MESSAGES.items():
        if name == "StringMap":
            continue
        msg = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            field = msg.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = f".{API_VERSION}.{type_name}"
        if name == "ContainerAllocateResponse":  # map<string, string> envs = 1; annotations = 4
            for entry in ("EnvsEntry", "AnnotationsEntry"):
                nested = msg.nested_type.add(name=entry)
                nested.options.map_entry = True
                for fname, number, ftype, label, _ in _MESSAGES["StringMap"]:
                    nested.field.add(name=fname, number=number, type=ftype, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{API_VERSION}.{name}"))
        for name in _MESSAGES
        if name != "StringMap"
    }


M = _build_messages()


def env_name(resource: str) -> str:
    """PCIDEVICE_IBM_COM_SPYRE_PF for ibm.com/spyre_pf."""
    return "PCIDEVICE_" + "".join(c if c.isalnum() else "_" for c in resource).upper()


def pci_addresses(count: int) -> list[str]:
    return [f"0000:{0x1A + i:02x}:00.0" for i in range(count)]


class TestDevicePlugin:
    """Serves `cards` cards of `resource` on a socket in the kubelet's device-plugin folder."""

    def __init__(
        self, resource: str = "ibm.com/spyre_pf", cards: int = 8, socket_dir: Path = KUBELET_SOCKET_DIR
    ):
        self.resource = resource
        self.devices = pci_addresses(cards)
        self.socket_dir = Path(socket_dir)
        self.endpoint = f"spyre-test-{resource.replace('/', '_')}.sock"
        self.allocations: list[list[str]] = []  # what the kubelet asked for, in order
        self._server: grpc.Server | None = None
        self._stop = threading.Event()

    # ---- DevicePlugin service --------------------------------------------------------------------

    def _options(self, request, context):
        return M["DevicePluginOptions"]()

    def _list_and_watch(self, request, context):
        yield M["ListAndWatchResponse"](devices=[M["Device"](ID=d, health="Healthy") for d in self.devices])
        while not self._stop.wait(1.0) and context.is_active():
            pass

    def _allocate(self, request, context):
        responses = []
        for creq in request.container_requests:
            ids = list(creq.devicesIDs)
            unknown = [i for i in ids if i not in self.devices]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown {self.resource} cards {unknown}")
            self.allocations.append(ids)
            responses.append(M["ContainerAllocateResponse"](envs={env_name(self.resource): ",".join(ids)}))
        return M["AllocateResponse"](container_responses=responses)

    def _pre_start(self, request, context):
        return M["PreStartContainerResponse"]()

    def _handler(self) -> grpc.GenericRpcHandler:
        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=M[req].FromString, response_serializer=M[resp].SerializeToString
            )

        return grpc.method_handlers_generic_handler(
            f"{API_VERSION}.DevicePlugin",
            {
                "GetDevicePluginOptions": unary(self._options, "Empty", "DevicePluginOptions"),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self._list_and_watch,
                    request_deserializer=M["Empty"].FromString,
                    response_serializer=M["ListAndWatchResponse"].SerializeToString,
                ),
                "Allocate": unary(self._allocate, "AllocateRequest", "AllocateResponse"),
                "PreStartContainer": unary(
                    self._pre_start, "PreStartContainerRequest", "PreStartContainerResponse"
                ),
            },
        )

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> TestDevicePlugin:
        """Serves on the plugin socket, then registers with the kubelet (retrying until it answers)."""
        sock = self.socket_dir / self.endpoint
        sock.unlink(missing_ok=True)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers((self._handler(),))
        self._server.add_insecure_port(f"unix://{sock}")
        self._server.start()
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                self._register()
                return self
            except grpc.RpcError as e:
                last = e
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the kubelet did not accept the device plugin within {timeout:.0f} s: {last}")

    def _register(self) -> None:
        with grpc.insecure_channel(f"unix://{self.socket_dir / 'kubelet.sock'}") as channel:
            register = channel.unary_unary(
                "/v1beta1.Registration/Register",
                request_serializer=M["RegisterRequest"].SerializeToString,
                response_deserializer=M["Empty"].FromString,
            )
            register(
                M["RegisterRequest"](
                    version=API_VERSION,
                    endpoint=self.endpoint,
                    resource_name=self.resource,
                    options=M["DevicePluginOptions"](),
                ),
                timeout=5,
            )

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.stop(grace=1).wait()
            self._server = None
        with contextlib.suppress(OSError):
            (self.socket_dir / self.endpoint).unlink()
