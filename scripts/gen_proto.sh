#!/usr/bin/env bash
# Regenerates src/elasticps/proto/*_pb2*.py from proto/. Run after editing a .proto file;
# tests/unit/test_proto_generated.py fails when the committed files are out of date.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-src/elasticps/proto}
python -m grpc_tools.protoc -Iproto \
  --python_out="$out" --grpc_python_out="$out" --mypy_out="$out" \
  proto/elasticps/v1/master.proto
# protoc writes into a package tree (elasticps/v1/); flatten it into elasticps.proto.
mv "$out"/elasticps/v1/master_pb2.py "$out"/elasticps/v1/master_pb2_grpc.py "$out"/elasticps/v1/master_pb2.pyi "$out"/
rm -r "$out"/elasticps
# The generated gRPC module imports "from elasticps.v1 import master_pb2"; point it at our package.
sed -i 's/^from elasticps.v1 import master_pb2/from elasticps.proto import master_pb2/' "$out"/master_pb2_grpc.py
