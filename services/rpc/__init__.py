"""Generated protobuf and gRPC modules of `proto/rekv/v1/rekv.proto` (`python -m rekv_cli.generate_rpc`).

Import them as `from services.rpc import rekv_pb2, rekv_pb2_grpc`.
"""

from services.rpc.rekv.v1 import rekv_pb2, rekv_pb2_grpc  # noqa: F401
