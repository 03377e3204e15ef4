"""The committed gRPC stubs are exactly what `python -m proto.generate` writes today."""

import subprocess
import sys


def test_committed_stubs_are_fresh():
    result = subprocess.run([sys.executable, "-m", "proto.generate", "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_stubs_import_from_the_proto_package():
    from proto.pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

    req = worker_pb2.PrefillRequest(request=worker_pb2.WorkerRequest(request_id="r", token_ids=[1, 2]),
                                    descriptor=b"x")
    assert worker_pb2.PrefillRequest.FromString(req.SerializeToString()).request.token_ids == [1, 2]
    assert hasattr(worker_pb2_grpc, "DecodeWorkerStub")
    assert generate_pb2.GenerateRequest(text="hi").WhichOneof("input") == "text"
