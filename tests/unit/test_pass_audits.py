"""The launcher's read of the pass audits: those etcd keeps, and those it saw before."""

from __future__ import annotations

import pytest

from elasticps.launcher.local import exactly_once_summary, read_pass_audits

pytestmark = pytest.mark.timeout(30)


class _Store:
    """The master kept the audits of passes 2 and 3 only."""

    def pass_summaries(self) -> dict[int, dict[str, object]]:
        return {2: {"pass_id": 2, "exactly_once": True}, 3: {"pass_id": 3, "exactly_once": True}}


def test_audits_seen_earlier_fill_in_those_the_master_no_longer_keeps() -> None:
    seen: dict[int, dict[str, object]] = {
        0: {"pass_id": 0, "exactly_once": True, "records_repaired": 5, "passes_repaired": []},
        1: {"pass_id": 1, "exactly_once": True, "records_repaired": 7, "passes_repaired": [0]},
        2: {"pass_id": 2, "exactly_once": False},  # etcd's copy wins
    }
    audits, missing = read_pass_audits(_Store(), 5, seen=seen)  # type: ignore[arg-type]
    assert [a["pass_id"] for a in audits] == [0, 1, 2, 3] and missing == [4]
    assert audits[2]["exactly_once"] is True
    summary = exactly_once_summary(audits, 4)
    assert summary["exactly_once"] is True
    assert (summary["records_repaired"], summary["passes_repaired"]) == (12, [0])
    assert read_pass_audits(_Store(), 4)[1] == [0, 1]  # type: ignore[arg-type]
