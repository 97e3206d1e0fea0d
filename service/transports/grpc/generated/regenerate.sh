#!/usr/bin/env sh
# Regenerate inference_pb2.py, inference_pb2.pyi and inference_pb2_grpc.py from
# ../proto/inference.proto with the installed grpcio-tools. Never edit the outputs
# by hand; run this from anywhere:
#
#     sh service/transports/grpc/generated/regenerate.sh
#
# Two scripted fix-ups of protoc's output (the only ones; checked below):
# - protoc writes `import inference_pb2 as inference__pb2` into the _grpc module;
#   make it package-relative so the folder works as a package.
# - the messages go into a private descriptor pool instead of the process-wide
#   default one. tritonclient.grpc's service_pb2 defines the same `inference.*`
#   names in the default pool, and protobuf refuses a second, different file
#   defining them: without this, rnnserve's server and tritonclient.grpc could
#   not be imported into one process (a test session, an app that is both).
#   The wire format does not depend on the pool. (With the pure-Python protobuf
#   backend, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python, the builder still
#   registers the classes in the default symbol database, so the two still clash
#   there; the default upb backend is fine.)
# The generated code pins the protobuf and grpcio runtimes it was made with
# (ValidateProtobufRuntimeVersion, GRPC_GENERATED_VERSION): keep the lower bounds
# of protobuf and grpcio in pyproject.toml at those versions after regenerating.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
proto_dir="$(cd "$here/../proto" && pwd)"
python -m grpc_tools.protoc \
    --proto_path="$proto_dir" \
    --python_out="$here" \
    --pyi_out="$here" \
    --grpc_python_out="$here" \
    "$proto_dir/inference.proto"
sed -i 's/^import inference_pb2 as inference__pb2$/from . import inference_pb2 as inference__pb2/' \
    "$here/inference_pb2_grpc.py"
sed -i 's/^DESCRIPTOR = _descriptor_pool\.Default()\.AddSerializedFile(/DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile(/' \
    "$here/inference_pb2.py"
grep -q '^from \. import inference_pb2 as inference__pb2$' "$here/inference_pb2_grpc.py"
grep -q '^DESCRIPTOR = _descriptor_pool\.DescriptorPool()\.AddSerializedFile(' "$here/inference_pb2.py"
