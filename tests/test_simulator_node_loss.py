"""`simulator.node_loss`: three policies for a node lost for good, against closed forms and a seeded
Monte-Carlo run of the same process.

Tolerances: with nodes returning, the Monte-Carlo run lasts 20,000 cluster MTBFs (its standard error is
below 0.002 in every case here) and the model must agree within 0.01 (exact for wait and relaunch; the
elastic restart term ignores state changes inside a restart window, about 0.003 here). With nodes never
returning, 400 seeded 12-hour runs are averaged (standard error below 0.005) and the tolerance is 0.02.
"""

from __future__ import annotations

import math

import pytest

from simulator import ettr
from simulator.calibrated import FITTED
from simulator.mechanisms import checkfreq_cost, moevement_cost
from simulator.model import preset_setting
from simulator.node_loss import (
    HOUR,
    LAZARUS_RECONFIG_S,
    EventCosts,
    FailureLaw,
    NodeCluster,
    Policy,
    binomial_pmf,
    cluster_of,
    elastic_pays_below,
    goodput,
    monte_carlo,
    paper_costs,
    report,
)
from simulator.presets import PAPER_PRESETS

SMALL = NodeCluster("16x8-pp2-ep8", nodes=16, gpus_per_node=8, pp=2, ep=8)  # 8 replicas of 2 nodes
COSTS = EventCosts(elastic_shrink_s=300.0, elastic_grow_s=200.0, wait_s=120.0, relaunch_s=600.0)


def test_layout_rule_keeps_pp_and_ep():
    big = cluster_of(PAPER_PRESETS["671B-16384"])  # 2048 nodes, 64 stages x 32 pipelines x ep 8
    assert (big.nodes, big.replicas(0)) == (2048, 32)
    assert [big.replicas(k) for k in (1, 64, 65, 128, 129)] == [31, 31, 30, 30, 29]
    assert big.used_nodes(31) == 31 * 64
    odd = NodeCluster("10 nodes, ep 16", nodes=10, gpus_per_node=8, pp=1, ep=16)  # a generic N
    assert [odd.replicas(k) for k in range(4)] == [5, 4, 4, 3]
    with pytest.raises(ValueError):
        NodeCluster("too small", nodes=1, gpus_per_node=8, pp=2, ep=8)


def test_binomial_pmf():
    for n, p in ((16, 0.1), (2048, 0.004), (64, 0.9)):
        pmf = binomial_pmf(n, p)
        assert sum(pmf.values()) == pytest.approx(1.0, abs=1e-12)
        assert sum(k * q for k, q in pmf.items()) == pytest.approx(n * p, rel=1e-9)
    assert binomial_pmf(8, 0.0) == {0: 1.0} and binomial_pmf(8, 1.0) == {8: 1.0}


def test_wait_is_the_closed_form():
    """Every node used: wait runs only while all are up ((1 - p)^N of the time), and each all-up period,
    Exp(N / node MTBF) long, starts with the restart: goodput = (1 - p)^N exp(-N c / node MTBF)."""
    wait = COSTS.policies()[1]
    for mtbf_s, return_s in ((1800.0, HOUR), (7200.0, 4 * HOUR)):
        law = FailureLaw.from_cluster_mtbf(SMALL, mtbf_s, return_s)
        p = return_s / (law.node_mtbf_s + return_s)
        expected = (1 - p) ** SMALL.nodes * math.exp(-SMALL.nodes * wait.grow_s / law.node_mtbf_s)
        assert goodput(SMALL, wait, law) == pytest.approx(expected, rel=1e-9)
    never = FailureLaw.from_cluster_mtbf(SMALL, 3600.0, math.inf, run_s=12 * HOUR)
    x = SMALL.nodes * never.rate * never.run_s  # no return: it runs until the first loss
    assert goodput(SMALL, wait, never) == pytest.approx(-math.expm1(-x) / x, abs=1e-3)


def test_policy_orderings():
    elastic, wait, relaunch = COSTS.policies()
    for mtbf_s in (600.0, 3600.0, 24 * HOUR):
        for return_s in (HOUR, 4 * HOUR, math.inf):
            law = FailureLaw.from_cluster_mtbf(SMALL, mtbf_s, return_s)
            a, b, c = (goodput(SMALL, p, law) for p in (elastic, wait, relaunch))
            assert 0.0 <= c <= b <= a <= 1.0  # relaunch: wait's downtime, dearer events
    one = NodeCluster("one replica", nodes=4, gpus_per_node=8, pp=4, ep=8)  # nothing to shrink to
    law = FailureLaw.from_cluster_mtbf(one, 1800.0, HOUR)
    same = Policy("elastic", True, 120.0, 120.0)
    assert goodput(one, same, law) == pytest.approx(goodput(one, COSTS.policies()[1], law), rel=1e-12)
    rarer = [goodput(SMALL, elastic, FailureLaw.from_cluster_mtbf(SMALL, m, HOUR)) for m in (600, 3600, 86400)]
    assert rarer == sorted(rarer)


@pytest.mark.parametrize(
    "cluster,costs,mtbf_s,return_s",
    [
        (SMALL, COSTS, 1800.0, HOUR),
        (SMALL, COSTS, 600.0, 4 * HOUR),
        (SMALL, COSTS, 7200.0, HOUR),
        (NodeCluster("10 nodes, ep 16", 10, 8, 1, 16), COSTS, 1800.0, HOUR),  # idle nodes stand in
        (cluster_of(PAPER_PRESETS["32B-512"]), paper_costs(PAPER_PRESETS["32B-512"]), 1800.0, HOUR),
    ],
)
def test_model_agrees_with_monte_carlo(cluster, costs, mtbf_s, return_s):
    law = FailureLaw.from_cluster_mtbf(cluster, mtbf_s, return_s)
    for seed, policy in enumerate(costs.policies()):
        simulated = monte_carlo(cluster, policy, law, horizon_s=20_000 * mtbf_s, seed=seed)
        assert goodput(cluster, policy, law) == pytest.approx(simulated, abs=0.01), policy.name


def test_model_agrees_with_monte_carlo_when_nodes_never_return():
    law = FailureLaw.from_cluster_mtbf(SMALL, 1800.0, math.inf, run_s=12 * HOUR)
    for policy in COSTS.policies():
        runs = [monte_carlo(SMALL, policy, law, law.run_s, seed=s) for s in range(400)]
        assert goodput(SMALL, policy, law) == pytest.approx(sum(runs) / len(runs), abs=0.02), policy.name


def test_break_even():
    elastic, wait, _ = COSTS.policies()

    def gain(mtbf_s: float, return_s: float) -> float:
        law = FailureLaw.from_cluster_mtbf(SMALL, mtbf_s, return_s)
        return goodput(SMALL, elastic, law) / goodput(SMALL, wait, law) - 1

    found = {r: elastic_pays_below(SMALL, COSTS, r, margin=0.05) for r in (HOUR, 4 * HOUR)}
    for return_s, b in found.items():
        assert 0.0 < b.cluster_mtbf_s < 365 * 24 * HOUR
        assert b.node_mtbf_s == pytest.approx(b.cluster_mtbf_s * SMALL.nodes)
        assert gain(0.99 * b.cluster_mtbf_s, return_s) > 0.05 >= gain(1.01 * b.cluster_mtbf_s, return_s)
    assert found[4 * HOUR].cluster_mtbf_s > found[HOUR].cluster_mtbf_s  # longer repairs: elasticity pays longer
    dear = EventCosts(elastic_shrink_s=1e9, elastic_grow_s=1e9, wait_s=0.0, relaunch_s=0.0)
    assert elastic_pays_below(SMALL, dear, HOUR).cluster_mtbf_s == 0.0


def test_paper_costs_come_from_the_mechanisms():
    preset = PAPER_PRESETS["145B-4096"]
    s, costs = preset_setting(preset), paper_costs(preset)
    assert costs.wait_s == pytest.approx(moevement_cost(s, FITTED).recovery_s)
    assert costs.relaunch_s == pytest.approx(checkfreq_cost(s, FITTED).recovery_s)
    assert costs.elastic_shrink_s > costs.elastic_grow_s > FITTED.restart_at(s.nodes)
    fast = paper_costs(preset, replan_s=LAZARUS_RECONFIG_S)
    assert costs.elastic_shrink_s - fast.elastic_shrink_s == pytest.approx(FITTED.restart_at(s.nodes) - 30.0)


def test_report_and_cli(capsys, monkeypatch):
    text = report((PAPER_PRESETS["32B-512"],))
    rows = [line for line in text.splitlines() if line.startswith("32B-512 ")]
    assert len(rows) == 15  # R in {1h, 4h, never} x MTBF in {10m, 30m, 1h, 4h, 24h}
    assert sum("R=" in line for line in text.splitlines()) == 3
    monkeypatch.setattr(ettr, "node_loss_report", lambda: "node-loss table")
    ettr.main(["--node-loss"])
    assert capsys.readouterr().out == "node-loss table\n"
