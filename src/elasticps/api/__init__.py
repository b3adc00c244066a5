"""The Python API: train, infer and run servers from a script or a notebook.

See :func:`elasticps.api.train.train`, :class:`elasticps.api.cluster.Local`
and :class:`elasticps.api.servers.LocalServers`.
"""
