"""A small fake Kubernetes API server for tests (standard library only).

See :mod:`fake_k8s.server`. It serves the real REST paths of pods, services
and configmaps, watch streams with resourceVersions, 410 Gone after
compaction, and test hooks for scheduling failures, quota errors,
preemption and pod exits, so the official ``kubernetes`` client and the
elasticps Kubernetes backend can be tested without a cluster.
"""

from fake_k8s.server import FakeKubeServer, parse_selector

__all__ = ["FakeKubeServer", "parse_selector"]
