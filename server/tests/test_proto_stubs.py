"""The committed gRPC stubs match proto/generate.proto (regenerate with `make proto` when this fails)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from specula_proto import generate_pb2

PROTO = Path(__file__).resolve().parents[2] / "proto"


def test_stubs_are_up_to_date(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path / "descriptor.pb"
    status = protoc.main(["protoc", f"--proto_path=specula_proto={PROTO}", f"--descriptor_set_out={out}",
                          str(PROTO / "generate.proto")])
    assert status == 0, "protoc failed on proto/generate.proto"
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _drop_json_names(fresh.message_type)
    committed = descriptor_pb2.FileDescriptorProto.FromString(generate_pb2.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "proto/specula_proto is stale: run `make proto`"


def _drop_json_names(messages) -> None:
    """Generated modules drop the derived json_name, nested messages' (a map's entry type) included; so do we."""
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def test_every_field_is_documented():
    """The contract is documented: each message field in the .proto has a comment line right above it."""
    lines = (PROTO / "generate.proto").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("//", "syntax", "option"))
        if is_field and not lines[i - 1].strip().startswith("//"):
            undocumented.append(stripped)
    assert not undocumented, undocumented
