"""A node lost for good: goodput of three policies when failed nodes come back only after a repair time.

    python -m simulator --node-loss      # the paper's clusters: goodput per policy, MTBF and repair time

The process. A cluster of N nodes of G GPUs; every node, busy or idle, fails as a Poisson process of rate
1 / node MTBF while it is up, and comes back `return_s` later (its repair, or a replacement's arrival,
whichever is first; `math.inf`: never within the run). Nodes are independent, so each is an alternating
renewal process and the number of nodes down at a random time is Binomial(N, R / (node MTBF + R)) -
exactly, whatever the repair-time distribution (insensitivity); down nodes return at rate 1 / R each.
Tables quote the *cluster* MTBF, the mean time between node losses of the whole cluster (the sense of
the MoEvement paper's §5.2 MTBFs and of Lazarus §6.2's "a node failure every 5 minutes"): the node MTBF
is N times it.

The job (`Policy`). It trains on whole data-parallel replicas: keep pp and ep, dp = world / pp, so one
replica is a pipeline of pp x ep GPUs and `replicas = floor(up GPUs / (pp x ep))`; throughput is
proportional to the replicas that run (the global batch is kept: more micro-batches per replica).
Nodes beyond the whole replicas are idle: an idle node's failure costs nothing, a used node's failure
costs `fail_s` of no progress (restart plus redone work) if the job can still run, and a return that
adds a replica costs `grow_s`. An event during such a restart starts it over.

- (a) elastic: runs on every whole replica that fits (an idle node stands in for a failed one).
- (b) wait: runs only at full strength; it stops until the node (or a spare) returns, then recovers as
  MoEvement does with a spare: only the returning node relaunches, state from replicas in memory.
- (c) relaunch: as (b), but every node relaunches from the persisted state (`persist_dir`) and redoes
  the work since the last persist; (b)'s survivors keep theirs in memory. Same downtime, dearer events.

Goodput = E[capacity] - E[time lost to restarts x capacity], the fraction of the full cluster's
throughput over a long run (`return_s` finite: the stationary law) or over `run_s` from a whole cluster
(`return_s` infinite: a node down at t with probability 1 - exp(-t / node MTBF)). A restart of c seconds
that lands in state j loses E[min(c, Y)] = (1 - exp(-nu c)) / nu, Y ~ Exp(nu) the time to the next event
that restarts it (used-node failures and growing returns, at state j's rates): exact for (b) and (c) when
every node is used at full strength (their only restart follows entry into "all up", whose sojourn is
Exp(N / node MTBF)); for (a) it ignores state changes inside a restart window (`monte_carlo` checks it).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from simulator.calibrated import FITTED, Calibration
from simulator.cluster import Preset
from simulator.mechanisms import checkfreq_cost, moevement_cost, node_network
from simulator.model import preset_setting
from simulator.presets import PAPER_PRESETS
from simulator.testbed import GPUS_PER_NODE, RUN_S

HOUR = 3600.0
# Lazarus §6.3: "each reconfiguration event takes 20~40 seconds" (failure to resumption, 10 GPUs); the middle.
LAZARUS_RECONFIG_S = 30.0
# Lazarus §1/§2: a failed node's replacement "may not be available for hours to days" (He et al., 2023).
TABLE_RETURN_S = (1 * HOUR, 4 * HOUR, math.inf)
# MoEvement §5.2 sweeps 2H-10M, Lazarus §6.2 uses 5 and 40 minutes; 4 h and a day add the rare end.
TABLE_MTBF_S = (600.0, 1800.0, 3600.0, 4 * HOUR, 24 * HOUR)
ELASTIC_MARGIN = 0.05  # "elasticity pays": (a) beats (b) by more than this fraction
PMF_FLOOR = 1e-15  # binomial terms below this share of the mode's are dropped


@dataclass(frozen=True)
class NodeCluster:
    """N nodes of G GPUs training pp-stage pipelines of ep-way expert parallelism (one replica = pp x ep GPUs)."""

    name: str
    nodes: int
    gpus_per_node: int
    pp: int
    ep: int

    def __post_init__(self) -> None:
        if min(self.nodes, self.gpus_per_node, self.pp, self.ep) < 1 or self.replicas(0) < 1:
            raise ValueError(f"{self.name}: {self.nodes} x {self.gpus_per_node} GPUs hold no pp x ep replica")

    def replicas(self, down: int) -> int:
        """Whole data-parallel replicas the up nodes hold (pp and ep kept, dp = world / pp)."""
        return max(0, self.nodes - down) * self.gpus_per_node // (self.pp * self.ep)

    def used_nodes(self, replicas: int) -> int:
        """Nodes that `replicas` replicas occupy (packed; the rest are idle)."""
        return math.ceil(replicas * self.pp * self.ep / self.gpus_per_node)


def cluster_of(preset: Preset) -> NodeCluster:
    """A scale-study preset's cluster: gpus / 8 nodes of 8 GPUs (the testbed's node, MoEvement §5.1)."""
    lay = preset.layout
    return NodeCluster(preset.name, lay.gpus // GPUS_PER_NODE, GPUS_PER_NODE, lay.pp, lay.ep)


@dataclass(frozen=True)
class Policy:
    """What the job does when nodes are down; seconds of no progress per event that restarts it."""

    name: str
    elastic: bool  # True: train on whatever whole replicas fit; False: only at full strength
    fail_s: float  # a used node fails and the job can still run: restart + redone work
    grow_s: float  # a return adds replicas (or lets a stopped job run again)

    def replicas(self, cluster: NodeCluster, down: int) -> int:
        """Replicas the job runs with `down` nodes down."""
        fit, full = cluster.replicas(down), cluster.replicas(0)
        return fit if self.elastic or fit == full else 0


@dataclass(frozen=True)
class EventCosts:
    """Seconds of no progress per event, per policy (see `paper_costs` for where each comes from)."""

    elastic_shrink_s: float
    elastic_grow_s: float
    wait_s: float
    relaunch_s: float

    def policies(self) -> tuple[Policy, Policy, Policy]:
        """(a) elastic, (b) wait for the node, (c) relaunch from persisted state."""
        return (
            Policy("elastic", True, self.elastic_shrink_s, self.elastic_grow_s),
            Policy("wait", False, self.wait_s, self.wait_s),
            Policy("relaunch", False, self.relaunch_s, self.relaunch_s),
        )


def paper_costs(preset: Preset, cal: Calibration = FITTED, replan_s: float | None = None) -> EventCosts:
    """Each policy's per-event cost on `preset`, from the simulator's mechanisms and fitted constants
    (`simulator.calibrated`, fitted on MoEvement Table 3's 2H and 1H rows; nothing here is fitted).

    - wait: MoEvement's localized recovery with a spare (`moevement_cost`: `restart_s`, fetching the W
      snapshots, conversion and catch-up, half an aborted iteration), paid when the node returns.
    - relaunch: a global restart from persisted state (`checkfreq_cost`: every node relaunched,
      the whole state read from storage, (k/2 + 1) T of rollback at the 3%-capped persist interval
      (MoEvement §5.2's CheckFreq policy), the newest persist's lag).
    - elastic shrink: a torchrun elastic restart relaunches every worker (`restart_at(nodes)`, or
      `replan_s` when given, e.g. `LAZARUS_RECONFIG_S`), the re-lay (a node's whole state over its NIC at
      the bulk rate: an upper bound) and the redone work of MoEvement's recovery beyond its restart.
      Grow: the same restart and re-lay, no redone work (joins at a step boundary, Lazarus §5).
    """
    s = preset_setting(preset)
    moevement = moevement_cost(s, cal).recovery_s
    restart = cal.restart_at(s.nodes) if replan_s is None else replan_s
    relay = s.node_state_bytes / node_network(s, cal).full
    redone = moevement - cal.restart_at(1)
    return EventCosts(restart + relay + redone, restart + relay, moevement, checkfreq_cost(s, cal).recovery_s)


@dataclass(frozen=True)
class FailureLaw:
    """Per-node Poisson failures and a fixed return time; `run_s` matters only when nodes never return."""

    node_mtbf_s: float
    return_s: float  # repair or replacement; math.inf: never within the run
    run_s: float = RUN_S  # MoEvement §5.2's 12-hour runs

    @classmethod
    def from_cluster_mtbf(
        cls, cluster: NodeCluster, cluster_mtbf_s: float, return_s: float, run_s: float = RUN_S
    ) -> FailureLaw:
        """The law whose whole, all-up cluster loses a node every `cluster_mtbf_s` on average."""
        return cls(cluster_mtbf_s * cluster.nodes, return_s, run_s)

    @property
    def rate(self) -> float:
        return 1.0 / self.node_mtbf_s

    @property
    def down_share(self) -> float:
        """Long-run probability that one node is down: R / (MTBF + R)."""
        return 1.0 if math.isinf(self.return_s) else self.return_s / (self.node_mtbf_s + self.return_s)


def binomial_pmf(n: int, p: float) -> dict[int, float]:
    """P(K = k) for K ~ Binomial(n, p), terms below `PMF_FLOOR` of the mode's dropped."""
    if p <= 0.0 or p >= 1.0:
        return {0 if p <= 0.0 else n: 1.0}
    lp, lq = math.log(p), math.log1p(-p)

    def log_term(k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq

    mode = min(n, int((n + 1) * p))
    top, floor = log_term(mode), math.log(PMF_FLOOR)
    lo, hi = mode, mode
    while lo > 0 and log_term(lo - 1) - top > floor:
        lo -= 1
    while hi < n and log_term(hi + 1) - top > floor:
        hi += 1
    return {k: math.exp(log_term(k)) for k in range(lo, hi + 1)}


def _lost_in_restart(cost_s: float, nu: float) -> float:
    """E[min(c, Y)], Y ~ Exp(nu): a restart of c seconds that the next event may start over."""
    return cost_s if nu <= 0.0 else -math.expm1(-nu * cost_s) / nu


def _rates(cluster: NodeCluster, policy: Policy, rate: float, return_rate: float, down: int) -> tuple[float, float]:
    """(used-node failure rate, growing-return rate) with `down` nodes down; both restart the job."""
    runs = policy.replicas(cluster, down)
    failing = cluster.used_nodes(runs) * rate if runs else 0.0
    grows = down > 0 and policy.replicas(cluster, down - 1) > runs
    return failing, (down * return_rate if grows else 0.0)


def _state_goodput(cluster: NodeCluster, policy: Policy, law: FailureLaw, pmf: dict[int, float]) -> float:
    """E[capacity] - E[restart losses] per second under the distribution `pmf` of nodes down."""
    full, lam = cluster.replicas(0), law.rate
    mu = 0.0 if math.isinf(law.return_s) else 1.0 / law.return_s

    def cap(k: int) -> float:
        return policy.replicas(cluster, k) / full

    def nu(k: int) -> float:
        return sum(_rates(cluster, policy, lam, mu, k))

    value = 0.0
    for k, pk in pmf.items():
        failing, growing = _rates(cluster, policy, lam, mu, k)
        value += pk * cap(k)
        if failing and cap(k + 1) > 0:
            value -= pk * failing * cap(k + 1) * _lost_in_restart(policy.fail_s, nu(k + 1))
        if growing:
            value -= pk * growing * cap(k - 1) * _lost_in_restart(policy.grow_s, nu(k - 1))
    return value


def goodput(cluster: NodeCluster, policy: Policy, law: FailureLaw, steps: int = 96) -> float:
    """Expected fraction of the full cluster's throughput, in [0, 1]: the stationary law when nodes return,
    else the mean over `run_s` from an all-up start (`steps` midpoints of the down probability)."""
    n = cluster.nodes
    if not math.isinf(law.return_s):
        return max(0.0, _state_goodput(cluster, policy, law, binomial_pmf(n, law.down_share)))
    total = 0.0
    for i in range(steps):
        p = -math.expm1(-law.rate * law.run_s * (i + 0.5) / steps)
        total += _state_goodput(cluster, policy, law, binomial_pmf(n, p))
    return max(0.0, total / steps)


def monte_carlo(cluster: NodeCluster, policy: Policy, law: FailureLaw, horizon_s: float, seed: int) -> float:
    """The same process simulated event by event from an all-up start: useful capacity-seconds / horizon.

    Failures are drawn per up node (memoryless, so redrawn after each event); the node hit is a used one
    with probability used / up; each down node returns exactly `return_s` after its failure.
    """
    rng, full = random.Random(seed), cluster.replicas(0)
    t, down, busy_until, useful = 0.0, 0, 0.0, 0.0
    returns: list[float] = []
    while t < horizon_s:
        up, runs = cluster.nodes - down, policy.replicas(cluster, down)
        t_fail = t + rng.expovariate(up * law.rate) if up else math.inf
        t_next = min(t_fail, returns[0] if returns else math.inf, horizon_s)
        if runs:
            useful += runs / full * max(0.0, t_next - max(t, busy_until))
        t = t_next
        if t >= horizon_s:
            break
        if t == t_fail:
            hit_used = rng.random() * up < cluster.used_nodes(runs)
            down += 1
            if not math.isinf(law.return_s):
                heapq.heappush(returns, t + law.return_s)
            if hit_used and policy.replicas(cluster, down):
                busy_until = t + policy.fail_s
        else:
            heapq.heappop(returns)
            down -= 1
            if policy.replicas(cluster, down) > runs:
                busy_until = t + policy.grow_s
    return useful / horizon_s


@dataclass(frozen=True)
class BreakEven:
    """The cluster MTBF below which elastic continuation beats waiting by more than `margin`."""

    cluster: str
    return_s: float
    margin: float
    cluster_mtbf_s: float  # the search's upper bound: pays at every MTBF searched; 0.0: at none
    node_mtbf_s: float


def elastic_pays_below(
    cluster: NodeCluster,
    costs: EventCosts,
    return_s: float,
    margin: float = ELASTIC_MARGIN,
    bounds_s: tuple[float, float] = (60.0, 365 * 24 * HOUR),
) -> BreakEven:
    """The largest cluster MTBF in `bounds_s` at which goodput(a) > (1 + margin) goodput(b): the largest
    point of a doubling grid (from the top down) where it holds, refined by bisection on log MTBF to 0.1%.

    `cluster_mtbf_s` is `bounds_s[1]` when (a) pays at the top of the range and 0.0 when it pays nowhere
    on the grid; between grid points (a)'s relative gain is taken to fall as failures get rarer.
    """
    elastic, wait, _ = costs.policies()

    def pays(mtbf_s: float) -> bool:
        law = FailureLaw.from_cluster_mtbf(cluster, mtbf_s, return_s)
        return goodput(cluster, elastic, law) > (1 + margin) * goodput(cluster, wait, law)

    lo, hi = bounds_s
    found, above, point = 0.0, hi, hi
    while point >= lo:
        if pays(point):
            found = point
            break
        above, point = point, point / 2
    if 0.0 < found < hi:
        low, high = found, above
        while high / low > 1.001:
            mid = math.sqrt(low * high)
            low, high = (mid, high) if pays(mid) else (low, mid)
        found = low
    return BreakEven(cluster.name, return_s, margin, found, found * cluster.nodes)


def _duration(seconds: float) -> str:
    """10m, 4h, 1536h; `never` for an infinite time."""
    if math.isinf(seconds):
        return "never"
    if seconds < HOUR:
        return f"{seconds / 60:.3g}m"
    return f"{seconds / HOUR:.3g}h" if seconds < 10 * HOUR else f"{seconds / HOUR:.0f}h"


def _rows(preset: Preset) -> list[str]:
    """One preset's table rows: every return time x cluster MTBF, then its per-event costs."""
    cluster, costs = cluster_of(preset), paper_costs(preset)
    fast = paper_costs(preset, replan_s=LAZARUS_RECONFIG_S).policies()[0]
    elastic, wait, relaunch = costs.policies()
    rows = []
    for return_s in TABLE_RETURN_S:
        for mtbf_s in TABLE_MTBF_S:
            law = FailureLaw.from_cluster_mtbf(cluster, mtbf_s, return_s)
            a, a30, b, c = (goodput(cluster, p, law) for p in (elastic, fast, wait, relaunch))
            ratio = ">100" if a > 100 * b else f"{a / b:.2f}"
            rows.append(
                f"{preset.name:<11} {cluster.nodes:>5} {cluster.replicas(0):>5}  {_duration(return_s):<5} "
                f"{_duration(mtbf_s):>5} {_duration(law.node_mtbf_s):>9}  {a:7.3f} {a30:11.3f} {b:6.3f} {c:8.3f}"
                f"  {ratio:>6}"
            )
    rows.append(
        f"  per event (s): elastic shrink {costs.elastic_shrink_s:.0f}, grow {costs.elastic_grow_s:.0f}"
        f" (at 30 s re-plan: {fast.fail_s:.0f}, {fast.grow_s:.0f}); wait {costs.wait_s:.0f};"
        f" relaunch {costs.relaunch_s:.0f}"
    )
    return rows


def _break_even_line(b: BreakEven, top_s: float) -> str:
    if b.cluster_mtbf_s == 0.0:
        where = "at no MTBF searched"
    elif b.cluster_mtbf_s >= top_s:
        where = f"at every MTBF up to {_duration(top_s)}"
    else:
        where = f"below {_duration(b.cluster_mtbf_s)} (node MTBF {_duration(b.node_mtbf_s)})"
    return f"  {b.cluster:<11} R={_duration(b.return_s):<6} {where}"


def report(presets: tuple[Preset, ...] = tuple(PAPER_PRESETS.values())) -> str:
    """The comparison `--node-loss` prints: goodput per preset x return time R x cluster MTBF, then where
    elastic continuation beats waiting by more than `ELASTIC_MARGIN` (R = never: over `RUN_S`)."""
    lines = [
        "goodput: fraction of the full cluster's throughput (model, not measured). MTBF: the cluster's mean time",
        "between node losses; node_MTBF = nodes x MTBF. R: a lost node's return (never: over a 12 h run).",
        "preset      nodes  pipe  R      MTBF node_MTBF  elastic elastic@30s   wait relaunch  a / b",
    ]
    top_s = 365 * 24 * HOUR
    breaks = []
    for preset in presets:
        lines += _rows(preset)
        cluster, costs = cluster_of(preset), paper_costs(preset)
        breaks += [elastic_pays_below(cluster, costs, r, bounds_s=(60.0, top_s)) for r in TABLE_RETURN_S]
    lines.append(f"elastic beats wait by more than {ELASTIC_MARGIN:.0%} (cluster MTBF):")
    lines += [_break_even_line(b, top_s) for b in breaks]
    return "\n".join(lines)
