"""The master's virtual source: tasks over the batches of a reader function."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticps.api.servers import ServersConfig
from elasticps.cli import build_parser
from elasticps.config import CommonConfig, MasterConfig
from elasticps.errors import ConfigError
from elasticps.master.main import VIRTUAL_SOURCE, build_spec

COMMON = CommonConfig(job="j", etcd_endpoint="127.0.0.1:2379")


def test_a_virtual_source_is_one_file_of_that_many_records() -> None:
    spec = build_spec(MasterConfig(COMMON, (), records_per_task=4, virtual_records=10))
    assert spec.files == ((VIRTUAL_SOURCE, 10),)
    assert [(r.file, r.start, r.end) for r in spec.ranges()] == [
        (VIRTUAL_SOURCE, 0, 4),
        (VIRTUAL_SOURCE, 4, 8),
        (VIRTUAL_SOURCE, 8, 10),
    ]


def test_the_master_takes_files_or_a_virtual_source_not_both_nor_neither() -> None:
    with pytest.raises(ConfigError, match="not both"):
        MasterConfig(COMMON, (Path("a.parquet"),), virtual_records=3)
    with pytest.raises(ConfigError, match="at least one data file"):
        MasterConfig(COMMON, ())
    with pytest.raises(ConfigError, match=">= 0"):
        MasterConfig(COMMON, (), virtual_records=-1)


def test_master_flag_virtual_records() -> None:
    args = build_parser().parse_args(["master", "--etcd", "h:1", "--virtual-records", "12"])
    assert args.virtual_records == 12
    assert args.data == [None]


def test_servers_config_needs_data_for_its_master() -> None:
    with pytest.raises(ConfigError, match="data_files or virtual_records"):
        ServersConfig()
    assert ServersConfig(with_master=False).num_ps == 1
    with pytest.raises(ConfigError, match="num_ps"):
        ServersConfig(num_ps=0, with_master=False)
    assert ServersConfig(job="x", virtual_records=3).job == "x"
    assert ServersConfig(virtual_records=3).job != ServersConfig(virtual_records=3).job
