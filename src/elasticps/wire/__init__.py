"""The tensor plane: length-prefixed binary frames over plain sockets.

Trainers push gradients to and pull parameters from the parameter servers over
this plane; the control plane (gRPC) never carries tensors. The frame format,
the request/reply pairs and the socket helpers live in
:mod:`elasticps.wire.frame`.
"""
