"""The committed generated protobuf modules match the .proto sources (regenerate: make proto)."""

import subprocess
import sys

from tahnode.proto import tahnode_pb2


def test_generated_modules_are_current():
    result = subprocess.run([sys.executable, "-m", "tahnode.proto.generate", "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_message_fields_keep_their_numbers():
    """Field numbers are the wire contract (docs/wire-format.md): never renumber or reuse."""
    fields = {f.name: f.number for f in tahnode_pb2.EncodedTensor.DESCRIPTOR.fields}
    assert fields == {"codec": 1, "version": 2, "shape": 3, "dtype": 4, "params": 5, "payload": 6, "crc32": 7,
                      "checksum": 8}
    mb = {f.name: f.number for f in tahnode_pb2.MicroBatch.DESCRIPTOR.fields}
    assert mb["step"] == 1 and mb["sample_ids"] == 3 and mb["labels"] == 4 and mb["tensor"] == 5
