"""mxps simulate: the fluid network, the placements it takes from the runtime, the job model's
bookkeeping, the command line, and the validated scenarios against mxps bench (drift)."""
import json

import pytest
import simpy

from mxps_tools.simulate import fluid, models, scenarios, systems, validate
from mxps_tools.simulate.calibration import Calibration
from mxps_tools.simulate.job import Job, WorkerClass


# --- the fluid network ------------------------------------------------------------------

def _net():
    env = simpy.Environment()
    return env, fluid.Network(env)


def test_two_connections_on_one_link_share_it_and_the_survivor_speeds_up():
    env, net = _net()
    link = net.resource("link", 100.0)
    a = net.connection([(link, 1.0)])
    b = net.connection([(link, 1.0)])
    done = {}
    net.send(a, 100.0, lambda: done.setdefault("a", env.now))
    net.send(b, 300.0, lambda: done.setdefault("b", env.now))
    env.run()
    # both at 50/s until a ends at 2 s; b then alone at 100/s for its last 200 bytes
    assert done["a"] == pytest.approx(2.0)
    assert done["b"] == pytest.approx(4.0)


def test_max_min_gives_the_unbottlenecked_connection_what_is_left():
    env, net = _net()
    x = net.resource("x", 10.0)
    y = net.resource("y", 100.0)
    a = net.connection([(x, 1.0), (y, 1.0)])    # held to 10 by x
    b = net.connection([(y, 1.0)])
    net.send(a, 1e9, lambda: None)
    net.send(b, 1e9, lambda: None)
    env.run(until=1.0)
    assert a.rate == pytest.approx(10.0)
    assert b.rate == pytest.approx(90.0)


def test_a_class_of_m_connections_weighs_m_on_the_shared_link():
    env, net = _net()
    server_down = net.resource("s down", 90.0)
    ups = [net.resource("w%d up" % i, 1000.0) for i in range(2)]
    big = net.connection([(ups[0], 1.0), (server_down, 2.0)])   # two workers alike
    one = net.connection([(ups[1], 1.0), (server_down, 1.0)])
    net.send(big, 1e9, lambda: None)
    net.send(one, 1e9, lambda: None)
    env.run(until=1.0)
    # three real connections share 90: 30 each
    assert big.rate == pytest.approx(30.0)
    assert one.rate == pytest.approx(30.0)


def test_a_capacity_change_applies_from_that_moment():
    env, net = _net()
    link = net.resource("link", 100.0)
    c = net.connection([(link, 1.0)])
    done = []
    net.send(c, 200.0, lambda: done.append(env.now))

    def slow_down():
        yield env.timeout(1.0)
        net.set_capacity(link, 25.0)
    env.process(slow_down())
    env.run()
    assert done == [pytest.approx(1.0 + 100.0 / 25.0)]


def test_priorities_reorder_only_what_is_not_committed_to_the_socket():
    env, net = _net()
    link = net.resource("link", 1.0)
    c = net.connection([(link, 1.0)], window=1.0)
    order = []
    for name, prio in (("first", 5), ("late-low", 9), ("late-high", 0)):
        net.send(c, 1.0, lambda name=name: order.append(name), priority=prio)
    env.run()
    # "first" is in the socket already; of the other two the higher priority goes next
    assert order == ["first", "late-high", "late-low"]


def test_fifo_connection_keeps_arrival_order():
    env, net = _net()
    link = net.resource("link", 1.0)
    c = net.connection([(link, 1.0)])
    order = []
    for name in ("a", "b", "c"):
        net.send(c, 1.0, lambda name=name: order.append(name))
    env.run()
    assert order == ["a", "b", "c"]


def test_a_resource_needs_a_positive_capacity():
    env, net = _net()
    with pytest.raises(ValueError, match="capacity"):
        net.resource("dead", 0)


# --- placement: the runtime's code -------------------------------------------------------

SIZES = [1_200_000, 300, 50_000, 2_400_000, 10]


def test_native_placement_is_mxnets_rule_from_the_runtime():
    from mxps.placement.plan import mxnet_default_rule
    t = systems.initial_table(systems.system("native"), SIZES, 3, 3, [1.0] * 3)
    assert t == {k: mxnet_default_rule(k, n, 3, 1000 * 1000) for k, n in enumerate(SIZES)}


def test_adaptive_placement_is_the_runtimes_split_for_the_probed_rates():
    from mxps.config import default_max_chunk
    from mxps.placement.adaptive import split_table
    rates = [50e6, 12.5e6, 50e6]
    t = systems.initial_table(systems.system("mxps-adaptive"), SIZES, 3, 3, rates)
    held = [2 * r / 6.0 for r in rates]
    assert t == split_table(list(enumerate(SIZES)), held, 16384, default_max_chunk(3))
    slow = sum(s.length for v in t.values() for s in v if s.server == 1)
    assert slow < sum(SIZES) / 3 / 2       # the slow server holds well under an even third


def test_p3_slices_keys_round_robin_over_servers_as_mxnet_encodes_them():
    t = systems.initial_table(systems.system("native-p3"), [100_000, 30_000], 3, 2, [1.0] * 3)
    assert [(s.server, s.offset, s.length) for s in t[0]] == [
        (0, 0, 40_000), (1, 40_000, 40_000), (2, 80_000, 20_000)]
    # the counter runs on over keys: key 1's one slice goes to the next server
    assert [(s.server, s.length) for s in t[1]] == [(0, 30_000)]


def test_unknown_system_or_setting_is_refused_naming_it():
    with pytest.raises(systems.SystemError_, match="unknown system 'mxps-magic'"):
        systems.system("mxps-magic")
    with pytest.raises(systems.SystemError_, match="MXPS_DIVERT=1"):
        systems.system("mxps-adaptive:MXPS_DIVERT=1")


# --- models -------------------------------------------------------------------------------

def test_zoo_models_and_a_json_model(tmp_path):
    r18 = models.load("resnet18_v1")
    assert 44e6 < r18.bytes < 45.5e6 and len(r18.keys) == 62
    # the mlp is arithmetic: the zoo's (built by MXNet) equals the formula
    assert models.load("mlp").keys == models.mlp(4096).keys
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"name": "two", "keys": [10, 20], "layer": [1, 0]}))
    m = models.load(str(p))
    assert m.keys == [10, 20] and m.backward_order() == [0, 1]
    p.write_text(json.dumps({"keys": [10, 20], "layer": [0, 0]}))
    with pytest.raises(models.ModelError, match="permutation"):
        models.load(str(p))
    with pytest.raises(models.ModelError, match="unknown model 'resnet9000'"):
        models.load("resnet9000")


# --- the job ------------------------------------------------------------------------------

def _job(name, rates, W=3, compute=0.1, **kw):
    m = models.Model("toy", [4_000_000, 1000, 2_000_000], [0, 1, 2])
    return Job(systems.system(name), m, [WorkerClass("w", W, 50e6, 50e6, compute)], rates,
               Calibration.load(), warmup=1, steps=4, **kw).run()


def test_a_communication_bound_step_is_no_faster_than_its_bytes_allow():
    j = _job("native", [50e6] * 3)
    model_bytes = 4 * 6_001_000
    # every server's link carries W x its part each way; even at a perfect split each server
    # takes W x M / (S x rate) per step
    assert j.mean_step() >= 3 * model_bytes / (3 * 50e6)
    assert len(j.step_times()[0]) == 4


def test_a_slow_server_slows_the_native_step_and_adaptive_placement_avoids_most_of_it():
    even = _job("native", [50e6] * 3).mean_step()
    slow = _job("native", [50e6, 12.5e6, 50e6]).mean_step()
    adaptive = _job("mxps-adaptive", [50e6, 12.5e6, 50e6]).mean_step()
    assert slow > 1.5 * even
    assert adaptive < 0.75 * slow


def test_adaptive_re_plans_after_a_link_changes_and_moves_state():
    j = _job("mxps-adaptive", [50e6] * 3, step_changes=[(2, {1: 12.5e6})])
    assert j.moves, "no re-plan after server 1 slowed to a quarter"
    assert j.moves[0]["round"] >= 3 and j.moves[0]["bytes"] > 0


def test_a_moves_bytes_by_server_pair_sum_to_the_runtimes_moved_bytes():
    from mxps.placement.adaptive import forced_table, moved_bytes
    keys = list(enumerate(SIZES))
    old, new = forced_table(keys, 3, 1), forced_table(keys, 3, 2)
    pairs = Job._moves(old, new)
    assert pairs and all(a != b for a, b in pairs)
    assert sum(pairs.values()) == moved_bytes(old, new)


def test_a_push_term_measured_at_two_rates_is_interpolated_in_log_rate():
    def grid(rate, lossy):
        return {"rate_mbit": rate, "loss": [0.0, 1.0], "bytes": [1e6, 1e7],
                "ratio": [[1.0, 1.0], [lossy, lossy]]}
    c = Calibration.load()
    data = dict(c.data, push_rounds={"tcp": [grid(400.0, 2.0), grid(100.0, 1.0)]})
    c = Calibration(data)
    mbit = 1e6 / 8.0
    eff = [c.push_efficiency("tcp", 1.0, 4e6, "push_rounds", rate=r * mbit)
           for r in (50.0, 100.0, 200.0, 400.0, 1000.0)]
    # clamped at the measured rates; halfway in log rate between them: ratio 1.5
    assert eff[0] == eff[1] == 1.0
    assert eff[2] == pytest.approx(1.0 / 1.5)
    assert eff[3] == eff[4] == pytest.approx(0.5)
    # without loss both grids say 1.0 whatever the rate
    assert c.push_efficiency("tcp", 0.0, 4e6, "push_rounds", rate=200 * mbit) == 1.0


def test_more_loss_never_speeds_up_an_incast_tcp_push():
    base = _job("native", [50e6], W=8, incast=True).mean_step()
    lossy = _job("native", [50e6], W=8, incast=True, loss_pct=5.0).mean_step()
    assert lossy >= base


# --- scenarios and the command line ---------------------------------------------------------

def test_scenarios_speak_the_bench_vocabulary(tmp_path):
    o = scenarios.Options(scenario="static", num_servers=3, slow_rank="0,2")
    vs = scenarios.variants(o)
    assert [v.tag for v in vs] == ["static-rank0", "static-rank2"]
    assert vs[1].server_rates[2] == pytest.approx(vs[1].server_rates[0] / 4)
    with pytest.raises(scenarios.ScenarioError, match="only 3 servers"):
        scenarios.variants(scenarios.Options(scenario="static", num_servers=3, slow_rank="5"))
    sched = tmp_path / "s.json"
    sched.write_text(json.dumps([[0, {"s1": 100}], [10, {"rank:1": 400, "w0": 50}]]))
    v = scenarios.variants(scenarios.Options(schedule=str(sched), num_servers=2))[0]
    assert v.server_rates[1] == pytest.approx(100e6 / 8)
    assert v.changes == [(10.0, {1: pytest.approx(400e6 / 8)})]


def test_the_command_prints_the_bench_table(capsys):
    from mxps_tools import cli
    assert cli.main(["simulate", "-n", "2", "-s", "2", "--scenario", "static", "--slow-rank",
                     "1", "--steps", "3", "--systems", "native,mxps-adaptive"]) == 0
    out = capsys.readouterr().out
    assert "simulated (not measured)" in out
    assert "static, server rank 1 slow" in out
    assert "mxps-adaptive" in out and "floor s" in out


def test_the_command_refuses_a_bad_model_naming_it():
    from mxps_tools import cli
    with pytest.raises(SystemExit, match="unknown model 'nope'"):
        cli.main(["simulate", "--model", "nope", "--steps", "2"])


# --- validation against mxps bench (drift) ----------------------------------------------

def test_every_validated_scenario_stays_within_its_tolerance():
    v = validate.load_validated()
    pairs = {(p["scenario"], p["system"]) for p in v["pairs"]}
    assert pairs, "validated.json lists no (scenario, system) pair"
    names = {s for s, _ in pairs}
    rows = validate.validate(names)
    got = {(r["scenario"], r["system"]): r for r in rows}
    drifted = ["%s %s: simulated %.3f s against %.3f measured (%+.1f%%), speedup %s"
               % (s, n, got[(s, n)]["simulated"], got[(s, n)]["measured"],
                  100 * got[(s, n)]["error"], got[(s, n)].get("speedup_error"))
               for s, n in sorted(pairs) if not validate.within(got[(s, n)], v["tolerance"])]
    assert not drifted, "drifted beyond %g: %s" % (v["tolerance"], drifted)
