"""The Python API: train, infer and run servers from a script or a notebook.

See :func:`elasticps.api.train.train`, :class:`elasticps.api.cluster.Local`,
:class:`elasticps.api.cluster.Hosts` (:mod:`elasticps.api.launch`) and
:class:`elasticps.api.servers.LocalServers`.
"""
