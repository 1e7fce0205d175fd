"""RankReports folds the ranks' KV-transfer reports into one (DESIGN rule 9), driven by
fabricated reports: invalid blocks are the union, a load or send is finished only once
every rank reported it, counters add up."""

from __future__ import annotations

from kvrecover.distributed.messages import RankReport
from kvrecover.distributed.rank_reports import RankReports
from kvrecover.step_messages import ModelRunnerOutput


def test_invalid_blocks_are_the_union_and_report_failures_spread():
    reports = RankReports(3)
    output = ModelRunnerOutput(invalid_block_ids={1}, kv_connector_errors=1,
                               kv_connector_stats={"loads": 2})
    reports.merge(output, [RankReport(invalid_block_ids={4, 5}, kv_connector_errors=2,
                                      kv_connector_stats={"loads": 3, "misses": 1}),
                           RankReport(kv_load_report_failed=True, kv_save_failed_blocks=2)])
    assert output.invalid_block_ids == {1, 4, 5}
    assert output.kv_load_report_failed
    assert output.kv_connector_errors == 3 and output.kv_save_failed_blocks == 2
    assert output.kv_connector_stats == {"loads": 5, "misses": 1}


def test_a_load_finishes_only_when_every_rank_reported_it():
    reports = RankReports(2)
    first = ModelRunnerOutput(finished_recving={"a", "b"}, finished_sending={"s"})
    reports.merge(first, [RankReport(finished_recving={"b"})])
    assert first.finished_recving == {"b"} and first.finished_sending == set()
    second = ModelRunnerOutput()
    reports.merge(second, [RankReport(finished_sending={"s"})])
    assert second.finished_recving == set() and second.finished_sending == {"s"}
    third = ModelRunnerOutput()
    reports.merge(third, [RankReport(finished_recving={"a"})])
    assert third.finished_recving == {"a"}
    fourth = ModelRunnerOutput(finished_recving={"a"})  # a new load of a reused id
    reports.merge(fourth, [RankReport()])
    assert fourth.finished_recving == set()
