"""Generated protobuf and gRPC modules for the control plane (see proto/). Do not edit."""
