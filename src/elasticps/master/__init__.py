"""The master: task queue, worker manager and the gRPC service that fronts them."""
