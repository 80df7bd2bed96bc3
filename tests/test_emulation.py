"""Emulated devices (``nexus.emulator``, issue 20; a tool apart from production, issue 51): calibrations and
service times, the device lanes, the control-signal policies (``critical`` order, load routing) as plain objects;
then one emulated 2-2-4 service (the real scheduler plugin, queues and task graph; updates, forwards and simulator
steps of calibrated time): the same plugin code drives it, a short run is deterministic for a fixed seed, the
isolated policy really isolates, and the accounting holds per device (busy <= wall). Times are read on the devices'
own clock (a test clock, the emulator's recorded spans), never as windows of the host's wall time."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from types import SimpleNamespace

import pytest

from nexus.config.service import ServiceConfig
from nexus.control.dispatch.training_queue import TenantLimits, TrainingItem, TrainingQueue
from nexus.deploy.processes import TRACKER_NICE
from nexus.emulator.clock import DeviceClock
from nexus.emulator.lanes import Lanes, lane_label
from nexus.emulator.lent import LentDevices
from nexus.emulator.piece import DevicePiece
from nexus.emulator.settings import Calibration, DeviceCounts, EmulationSettings, ServiceTimes, load_calibration
from nexus.errors import SpecError

EMU = {"calibration": "paper_gpu", "time_scale": 20, "devices": {"actor": 2, "inference": 2, "simulator": 4}}
EMU10 = {**EMU, "time_scale": 10}


class Clock:
    """A wall clock of the test's own: the devices' clock then reads exact times, whatever the host's load."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


# -- plain objects ------------------------------------------------------------------------------------------
def test_calibration_files_load_with_their_source_and_bad_ones_name_the_file(tmp_path):
    cal = load_calibration("paper_gpu")
    assert cal.name == "paper_gpu" and "arXiv" in cal.source
    bad = tmp_path / "bad.toml"
    bad.write_text('source = "x"\n[forward.default]\ncall_s = -1\nrow_s = 0\n[update.rl]\ncall_s = 0\nrow_s = 0\n'
                   '[update.sft]\ncall_s = 0\nrow_s = 0\n[env.default]\nstep_s = 0\n')
    with pytest.raises(SpecError, match=r"bad.toml.*forward.default.call_s"):
        load_calibration(str(bad))
    nosource = tmp_path / "nosource.toml"
    nosource.write_text(bad.read_text().replace('source = "x"\n', "").replace("-1", "0"))
    with pytest.raises(SpecError, match="source"):
        load_calibration(str(nosource))
    with pytest.raises(SpecError, match="calibrations/ has: .*paper_gpu"):
        load_calibration("no-such-calibration")


def test_service_times_group_batching_time_scale_and_data_parallel_groups():
    cal = load_calibration("paper_gpu")
    one, ten = ServiceTimes(cal, 1.0), ServiceTimes(cal, 10.0)
    grouped = one.forward_s({"oft": 32}, tenants=8)
    separate = 8 * one.forward_s({"oft": 4}, tenants=1)
    assert separate / grouped == pytest.approx(3.24, rel=0.01)  # the paper's Exp. 2 OFT speed-up at 8 x 4
    assert ten.forward_s({"oft": 4}, 1) == pytest.approx(one.forward_s({"oft": 4}, 1) / 10)
    assert ten.step_s("robosuite/lift-state", 8) == pytest.approx(one.step_s("robosuite/lift-state", 8) / 10)
    t1, t2 = one.update_s("rl", 1000, 4, devices=1), one.update_s("rl", 1000, 4, devices=2)
    assert t1 / t2 == pytest.approx(2 * cal.dp_efficiency)
    assert one.env("no/such-env") == cal.env["default"]


def test_emulator_settings_live_outside_the_service_config_and_shape_it(tmp_path):
    from pydantic import ValidationError

    from nexus.emulator.service import configure
    from nexus.emulator.settings import FILE

    with pytest.raises(ValidationError, match="emulation"):
        ServiceConfig(root="/tmp/x", emulation=EMU)  # not a service setting
    emu = EmulationSettings.model_validate(EMU)
    cfg = configure(ServiceConfig(root="/tmp/x"), emu)
    assert cfg.inference_engines == 2 and cfg.resolved_tracker_worker() and emu.table is not None
    assert not configure(ServiceConfig(root="/tmp/x", cluster={"tracker_worker": False}), emu).resolved_tracker_worker()
    emu.save(tmp_path / FILE)  # the workers' copy carries the loaded table
    assert EmulationSettings.read(tmp_path / FILE) == emu
    (tmp_path / "bad.json").write_text('{"calibration": "paper_gpu", "time_scale": -1}')
    with pytest.raises(SpecError, match=r"bad.json.*time_scale"):
        EmulationSettings.read(tmp_path / "bad.json")
    with pytest.raises(SpecError, match="one actor rank"):
        configure(ServiceConfig(root="/tmp/x", actor_ranks=2), emu)
    with pytest.raises(SpecError, match="inference_engines 3 differs"):
        configure(ServiceConfig(root="/tmp/x", inference_engines=3), emu)
    with pytest.raises(ValueError, match="actor_group 3 must divide"):
        EmulationSettings(calibration="paper_gpu", devices={"actor": 4}, actor_group=3)
    with pytest.raises(ValueError, match="producers_per_sim"):
        EmulationSettings(calibration="paper_gpu", producers_per_sim=0)
    elastic = ServiceConfig(root="/tmp/x", scheduler="elastic")  # the policy's split reaches the dispatch settings
    assert elastic.dispatch.rollout_split == 4 and ServiceConfig(root="/tmp/x").dispatch.rollout_split == 1
    assert elastic.dispatch.rollout_split_rule == "always"
    assert DeviceCounts.parse("16-16-32").total == 64
    with pytest.raises(SpecError, match="actor-inference-simulator"):
        DeviceCounts.parse("2-2")
    assert isinstance(emu.table, Calibration)


def test_device_work_on_the_hosts_cores_is_charged_the_host_time_the_shared_cores_made_it(tmp_path, monkeypatch):
    from nexus.emulator import engine as engine_mod
    from nexus.emulator.engine import EmulatedEngine
    from nexus.emulator.host import spend_cpu

    # it spends CPU of its own thread (what the operating system shares between the services), not a sleep
    cpu = time.thread_time()
    spend_cpu(0.02)
    assert time.thread_time() - cpu >= 0.02
    # a producer's steps: charged the host time they took (3x their calibrated CPU: others shared the cores), and
    # the time waited for the device's lock (another producer's step on it) as queued, not as stepping
    host = Clock()

    class Taken:  # the device's lock, held 0.5 s by another producer's step
        def __enter__(self) -> None:
            host.advance(0.5)

        def __exit__(self, *exc: object) -> None:
            return None

    clock = DeviceClock(now=host)
    assert clock.spend_on_host(0.1, Taken(), spend=lambda s: host.advance(3 * s)) == pytest.approx(0.3)
    assert clock.slept == pytest.approx(0.3) and clock.queued == pytest.approx(0.5) and clock.debt == 0.0
    # an engine's forward: its handling per request (the calibration's [host], charged to no device), then the
    # forward, charged its host time
    cal = tmp_path / "cpu.toml"
    cal.write_text('source = "test"\n[host]\nengine_request_s = 0.001\n[forward.default]\ncall_s = 0.002\n'
                   'row_s = 0.001\n[update.rl]\ncall_s = 0.1\nrow_s = 0\n[update.sft]\ncall_s = 0.02\nrow_s = 0\n'
                   '[env.default]\nstep_s = 0.01\n')
    spent: list[float] = []
    monkeypatch.setattr(engine_mod, "spend_cpu", lambda s: spent.append(s) or 2 * s)
    eng = EmulatedEngine(ServiceConfig(root=str(tmp_path)),
                         EmulationSettings(calibration=str(cal), device_work="host_cpu"))
    eng.heads.specs["a"] = (SimpleNamespace(env="e", action_head="oft"), SimpleNamespace(action_dim=4))
    eng.heads.live["a"] = (1, None)
    asyncio.run(eng._forward_group([SimpleNamespace(tenant="a", version=None)] * 3))
    assert spent == [pytest.approx(0.003), pytest.approx(0.005)]  # 3 requests' handling; call + 3 rows
    assert eng._busy == pytest.approx(0.010) and eng.queue.compute_of(0.0) == eng._busy
    eng.close()
    # seconds of CPU are not divided by a time scale, and work on the host's cores lends no device
    for bad in ({"time_scale": 10}, {"lend_actor": True}, {"lend_inference": True}):
        with pytest.raises(ValueError, match="host_cpu"):
            EmulationSettings(calibration=str(cal), device_work="host_cpu", **bad)


def test_lanes_hold_distinct_devices_and_wait_when_all_are_busy():
    lanes = Lanes(2)
    assert lane_label("sim-0", 1, 0) == "sim-0" and lane_label("sim-0", 4, 3) == "sim-0#3"
    got: list[list[int]] = []
    with lanes.hold(2) as both:
        assert sorted(both) == [0, 1] and lanes.busy == 2
        t = threading.Thread(target=lambda: got.append(lanes.hold(1).__enter__()))
        t.start()
        t.join(0.2)
        assert t.is_alive() and not got  # no free device: it waits, as work waits for hardware
    t.join(5)
    assert got and got[0][0] in (0, 1)


def placed(lanes: Lanes, seconds: float, lent: LentDevices,
           unit: float | None = None) -> tuple[float, DevicePiece | None]:
    """A piece placed on lane 0 or on a device ``lent``: -> (its wait, the lent device's piece; None on its own)."""
    wait, piece, borrowed = lanes.place(0, seconds, lent=lent, unit=unit)
    return wait, piece if borrowed else None


def test_shared_lanes_spread_first_and_their_device_work_takes_turns():
    lanes = Lanes(2, share=2)
    with lanes.hold() as a, lanes.hold() as b, lanes.hold() as c, lanes.hold() as d:
        assert (a, b, c, d) == ([0], [1], [0], [1])  # the least held lane first: spread, then share
        got: list[list[int]] = []
        t = threading.Thread(target=lambda: got.append(lanes.hold(1).__enter__()))
        t.start()
        t.join(0.2)
        assert t.is_alive() and not got  # both lanes hold two producers: a fifth waits
    t.join(5)
    assert got
    # a device runs one piece of work at a time, in the order asked (on a clock of the test's own: exact waits)
    clock = Clock()
    lanes.now = clock
    assert lanes.occupy(0, 0.5) == 0.0
    clock.advance(0.02)
    assert lanes.occupy(0, 0.2) == pytest.approx(0.48)
    assert lanes.occupy(0, 0.1) == pytest.approx(0.68)  # behind both
    assert lanes.occupy(1, 0.3) == 0.0  # another device: idle
    # a producer owing 0.1 s of host time arrived 0.1 s earlier on the devices' clock: it waits that much longer
    assert lanes.occupy(1, 0.1, ahead=0.1) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="at least one holder"):
        Lanes(2, share=0)


def test_a_device_runs_the_pieces_in_their_order_on_the_devices_clock_not_in_the_hosts():
    """A producer owing host time reaches its device late, but came earlier on the devices' clock: its piece goes
    ahead of those queued since whose producers still sleep on them — they are pushed back, the device never running
    two at once — and never ahead of one whose producer went on."""
    clock = Clock()
    lanes = Lanes(1, now=clock)
    _, first, _ = lanes.place(0, 0.5)
    clock.advance(0.1)
    wait, later, _ = lanes.place(0, 0.2)
    assert wait == pytest.approx(0.4) and later.start == first.end
    wait, early, lent = lanes.place(0, 0.1, ahead=0.05)  # owes 0.05 s: arrived before ``later`` did, after ``first``
    assert not lent and early.start == first.end and wait == pytest.approx(0.45) and first.pushed == 0
    assert later.pushed == pytest.approx(0.1) and later.end == pytest.approx(early.end + 0.2)
    assert later.wait_cut(0) == (0, pytest.approx(0.1))  # its producer sleeps the push and goes on
    _, last, _ = lanes.place(0, 0.1, ahead=5.0)  # earlier than all, but ``later``'s producer went on
    assert last.start == later.end and later.pushed == pytest.approx(0.1)
    pieces = sorted((first, early, later, last), key=lambda p: p.start)
    assert all(b.start + b.pushed >= a.end - 1e-9 for a, b in itertools.pairwise(pieces))  # one at a time
    # a piece over leaves the queue, not its end: one that came before it on the devices' clock starts after it
    lanes, t0 = Lanes(1, now=clock), clock()
    assert lanes.occupy(0, 0.05) == 0.0
    clock.advance(0.1)
    _, now, _ = lanes.place(0, 0.01)  # the first is over
    _, before, _ = lanes.place(0, 0.2, ahead=0.12)  # came before the first's end
    assert before.start == pytest.approx(t0 + 0.05) and now.start == t0 + 0.1
    assert now.start + now.pushed == pytest.approx(before.end)  # pushed behind it


def test_shared_lanes_take_the_least_loaded_device_when_holders_say_their_load():
    """``EmulationSettings.sim_placement = "load"``: a producer that steps most of its time is not put to take turns
    with another such producer while a device holds one that mostly waits for actions."""
    lanes = Lanes(2, share=2)
    with lanes.hold(load=0.9) as heavy, lanes.hold(load=0.3) as light:
        assert (heavy, light) == ([0], [1])
        with lanes.hold(load=0.3) as third:
            assert third == [1]  # by count alone it would be lane 0 (1 holder each, the lower index)
            with lanes.hold(load=0.9) as fourth:
                assert fourth == [0]  # lane 1 is full: the only room left
        with lanes.hold(load=0.5) as again:
            assert again == [1]  # the third's load left with it: lane 1 holds 0.3 against 0.9
    with lanes.hold() as a, lanes.hold() as b, lanes.hold() as c:
        assert (a, b, c) == ([0], [1], [0])  # nothing said, nothing left over: spread by count, as before


def test_a_busy_simulator_device_borrows_a_lent_one_until_its_owner_takes_it_back():
    """``EmulationSettings.lend_actor``: a piece of device work whose own device is busy runs on a device another
    service lends, when it starts sooner there; taken back, the device starts no new step: a piece on it is cut at
    its next step boundary and its owner learns when the steps that run end."""
    clock = Clock()
    lanes, lent = Lanes(1, now=clock), LentDevices(now=clock)
    assert placed(lanes, 0.5, lent=lent) == (0.0, None)  # nothing lent: its own device, idle
    clock.advance(0.02)
    wait, piece = placed(lanes, 0.2, lent=lent)
    assert piece is None and wait == pytest.approx(0.48)  # nothing lent yet: it queues behind its device's piece
    lent.lend(["actor-0#0"], free_at=clock() + 0.1)  # idle from 0.1 s on
    wait, reset = placed(lanes, 0.3, lent=lent)
    assert reset.device == "actor-0#0" and reset.ran == pytest.approx(0.3) and wait == pytest.approx(0.1)  # sooner
    wait, chunk = placed(lanes, 0.4, lent=lent, unit=0.1)  # 4 steps, behind the lent device's 0.3 s
    assert chunk.device == "actor-0#0" and chunk.start == reset.end and wait == pytest.approx(0.4)
    back = lent.reclaim(["actor-0#0"], at=reset.start + 0.15)  # in the reset, a piece of one step
    assert back == reset.end and lent.lent == []  # the reset runs to its end, the chunk not at all
    assert reset.wait_cut(0) == (0, 0) and chunk.wait_cut(0) == (pytest.approx(0.4), 0)
    wait, piece = placed(lanes, 0.3, lent=lent, unit=0.1)
    assert piece is None and wait == pytest.approx(0.68)  # taken back: the rest on its own device, however late

    lent.lend(["actor-0#0", "actor-0#1"], free_at=clock())  # lent again: the reset queued there is not forgotten
    _, chunk = placed(lanes, 0.4, lent=lent, unit=0.1)
    assert chunk.device == "actor-0#1"
    assert lent.reclaim(["actor-0#1"], at=chunk.start + 0.15) == pytest.approx(chunk.start + 0.2)  # after 2 steps
    assert chunk.ran == pytest.approx(0.2) and chunk.wait_cut(0) == (pytest.approx(0.2), 0)
    assert placed(Lanes(1, now=clock), 0.1, lent=lent) == (0.0, None)  # an idle own device is never left
    lent.lend(["actor-0#1"], free_at=clock())
    _, done = placed(lanes, 0.4, lent=lent, unit=0.1)
    assert done.wait_cut(0) == (0, 0)  # its producer went on with all 4 steps
    assert lent.reclaim([done.device], at=done.end) == done.end and done.revoked == 0  # taken back after: all ran


def test_a_device_taken_back_at_its_owners_start_revokes_the_steps_lent_since_for_their_producer_to_run_again():
    """The actor's message to take its devices back arrives a host's dispatch after the update's start on the
    devices' clock; it takes them back at that start. A piece whose producer went on already ran the steps begun
    since: they are revoked (the producer runs them again on its own device, and owes the time it slept for them),
    and the update starts after the last step begun before its start."""
    wall = Clock()
    lent = LentDevices(now=wall)
    lent.lend(["actor-0#0"], free_at=wall())
    first = lent.take(wall(), 0.4, before=wall() + 1, unit=0.1)
    second = lent.take(wall(), 0.2, before=wall() + 1, unit=0.1)
    assert first.wait_cut(0) == (0, 0) and second.wait_cut(0) == (0, 0)  # both producers went on
    back = lent.reclaim(["actor-0#0"], at=first.start + 0.25)  # in first's third step; second not begun then
    assert back == pytest.approx(first.start + 0.3)
    assert (first.ran, first.revoked) == (pytest.approx(0.3), pytest.approx(0.1))
    assert (second.ran, second.revoked) == (0, pytest.approx(0.2))
    assert second.take_revoked() == pytest.approx(0.2) and second.take_revoked() == 0  # said once
    lent.lend(["actor-0#0"], free_at=wall())
    lent.reclaim(["actor-0#0"], at=wall())  # nothing queued since: nothing revoked
    assert first.revoked == pytest.approx(0.1)
    lent = LentDevices(now=wall)
    lent.lend(["actor-0#0"], free_at=wall() - 1.0)
    early = lent.take(wall() - 1.0, 0.1, before=wall(), unit=0.1)  # over before the next could start
    later = lent.take(wall(), 0.1, before=wall() + 1, unit=0.1)
    assert early.wait_cut(0) == later.wait_cut(0) == (0, 0)
    assert lent.reclaim(["actor-0#0"], at=early.start) == early.start  # a dispatch of a second: both still revoked
    assert (early.revoked, later.revoked) == (pytest.approx(0.1), pytest.approx(0.1))
    lent.lend(["actor-0#0"], free_at=wall() - 0.05)
    now = wall()
    assert lent.take(now - 0.5, 0.1, before=now + 1, unit=0.1) is None  # made before it was lent (its host late)
    ahead = lent.take(wall() + 0.5, 0.2, before=wall() + 1, unit=0.1)  # its producer owes nothing: later
    assert ahead.wait_cut(0) == (0, 0)
    at = ahead.start - 0.4  # taken back before it began: it never runs there, and its owner does not wait for it
    assert lent.reclaim(["actor-0#0"], at=at) == at and ahead.revoked == pytest.approx(0.2)

    clock = DeviceClock()
    clock.spend(0.4)
    clock.revoke(0.1)  # of the 0.4 s slept, 0.1 s did not count: run again, the time slept for it owed
    assert clock.slept == pytest.approx(0.3) and clock.debt == pytest.approx(0.1)


def test_a_producer_cut_short_on_a_lent_device_sleeps_and_spends_only_the_steps_that_ran():
    lent, clock = LentDevices(), DeviceClock()
    lent.lend(["actor-0#0"], free_at=time.time())
    # a minute of steps of 0.2 s: only the take-back, in its first step on the devices' clock, ends it sooner
    piece = lent.take(time.time(), 60.0, before=time.time() + 100, unit=0.2)
    taken = threading.Event()

    def sleep_on(timeout: float) -> tuple[float, float]:  # the owner takes its device back while the producer sleeps
        def reclaim() -> None:
            lent.reclaim(["actor-0#0"], at=piece.start + 0.1)
            taken.set()

        threading.Thread(target=reclaim).start()
        return piece.wait_cut(timeout)

    assert clock.spend(60.0, cut=sleep_on) == pytest.approx(0.2)  # woken by it: the one step begun ran
    assert taken.is_set() and piece.ran == pytest.approx(0.2) and clock.slept == pytest.approx(0.2)
    clock.debt = 0.5  # owed host time paid out of the piece is owed again for the steps cut off it
    lent.lend(["actor-0#0"], free_at=time.time())
    piece = lent.take(time.time(), 0.6, before=time.time() + 1, unit=0.2)
    piece.cut(piece.start)
    assert clock.spend(0.6, cut=piece.wait_cut) == 0 and clock.debt == pytest.approx(0.5)


def test_an_engines_forward_is_time_sliced_with_the_lent_pieces_on_its_device_and_pushes_them_back():
    """``EmulationSettings.lend_inference`` at the default contention (2: an even time-slice): the piece running when
    an engine's forward begins on its lent device, and those queued after it, end later by what they lose to it; a
    piece whose producer went on is not pushed; and a producer takes that device only when its piece is expected to
    end sooner there, at the share of the device the engine leaves."""
    wall = Clock()
    lanes, lent, d = Lanes(1, now=wall), LentDevices(now=wall), "infer-0#0"
    assert placed(lanes, 0.5, lent=lent) == (0.0, None)  # its own device busy for 0.5 s
    now = wall()
    lent.preempt(d, at=now, seconds=0.1)  # a forward: the device is lent from its end on
    assert lent.lent == [d]
    _, p1 = placed(lanes, 0.2, lent=lent, unit=0.1)
    _, p2 = placed(lanes, 0.2, lent=lent, unit=0.1)
    assert (p1.device, p2.device) == (d, d) and p1.start == pytest.approx(now + 0.1) and p2.start == p1.end
    lent.preempt(d, at=p1.start + 0.05, seconds=0.1, share=0.5)  # in p1's first step
    assert (p1.pushed, p2.pushed) == (pytest.approx(0.1), pytest.approx(0.1))
    assert p1.end == pytest.approx(now + 0.4) and p2.end == pytest.approx(now + 0.6)
    lent.preempt(d, at=p2.end + 0.1, seconds=0.05)  # in a gap: nothing pushed
    assert p2.pushed == pytest.approx(0.1)
    assert p1.wait_cut(0) == (0, pytest.approx(0.1))  # (sleeps the push: 0.1 s) its producer went on: not pushed
    lent.preempt(d, at=p1.start + 0.2, seconds=0.05, share=0.5)  # in p1's last step
    assert p1.pushed == pytest.approx(0.1) and p1.missed == pytest.approx(0.05)  # heard of too late: counted
    assert p2.pushed == pytest.approx(0.1) and p2.missed == 0  # p1 keeps its end: p2 starts then, as before
    # at half the device, 0.4 s there (from 0.75 s on) would end 0.65 s after it does on its own device (free 0.5 s
    # from now): it queues there instead
    wait, piece = placed(lanes, 0.4, lent=lent, unit=0.1)
    assert piece is None and wait == pytest.approx(0.5)
    far = lent.take(wall(), 0.1, before=wall() + 5.0)  # 0.1 s at half the device, 5 s sooner there
    assert far is not None and far.device == d


def test_a_forward_and_lent_steps_sharing_a_gpu_both_progress_the_contention_factor_slower(tmp_path):
    """Physical model: an engine and a simulator are two processes; without MPS a GPU time-slices them. While a
    forward and a lent piece overlap, each progresses ``lend_contention`` times slower: the piece is pushed back by
    (c - 1) x the seconds they share, the forward ends as much later; alone, neither is slowed."""
    from nexus.emulator.engine import EmulatedEngine
    from nexus.emulator.settings import TIME_SLICED_CONTENTION

    assert EmulationSettings(calibration="paper_gpu").lend_contention == TIME_SLICED_CONTENTION == 2.0
    with pytest.raises(ValueError, match="lend_contention"):
        EmulationSettings(calibration="paper_gpu", lend_contention=0.5)  # faster together than alone: refused
    wall, d, c = Clock(), "infer-0#0", 3.0
    lent = LentDevices(now=wall, contention=c)
    assert lent.preempt(d, at=wall(), seconds=0.1) == pytest.approx(wall() + 0.1)  # nothing lent there: alone
    long = lent.take(wall() + 0.1, 1.0, before=wall() + 5, unit=0.1)
    end = lent.preempt(d, at=long.start + 0.2, seconds=0.1)  # a 0.1 s forward inside the piece
    assert end == pytest.approx(long.start + 0.2 + c * 0.1)  # 3 x slower while they share the device
    assert long.pushed == pytest.approx((c - 1) * 0.1) and long.end == pytest.approx(long.start + 1.2)
    short = lent.take(wall() + 5, 0.1, before=wall() + 10, unit=0.1)
    end = lent.preempt(d, at=short.start, seconds=0.5)  # the piece ends first: the forward's rest runs alone
    assert short.pushed == pytest.approx((c - 1) * 0.1) and end == pytest.approx(short.start + 0.5 + (c - 1) * 0.1)

    # the engine charges its forward the same, from what the simulator workers told its worker (``occupied``)
    occupied: dict[str, float] = {}
    emu = EmulationSettings.model_validate({**EMU10, "lend_contention": c})
    eng = EmulatedEngine(ServiceConfig(root=str(tmp_path)), emu, device=d, occupied=occupied)
    assert eng.shared_s(0.01, start=100.0) == 0.01  # no lent work on its device: alone
    occupied[d] = 100.005  # lent steps until halfway through the forward
    assert eng.shared_s(0.01, start=100.0) == pytest.approx(0.01 + (c - 1) * 0.005)
    eng.heads.specs["a"] = (SimpleNamespace(env="maniskill/pushcube-state", action_head="oft"),
                            SimpleNamespace(action_dim=4))
    eng.heads.live["a"] = (1, None)
    occupied[d] = time.time() + 60  # lent steps throughout: the whole forward shares the device
    eng.queue.waits_of([time.monotonic() - 5.0], time.monotonic(), "all_waiting")
    asyncio.run(eng._forward_group([SimpleNamespace(tenant="a", version=None)] * 4))
    alone = emu.times().forward_s({"oft": 4}, 1)
    assert eng._busy == pytest.approx(c * alone) and eng.queue.compute_of(0.0) == pytest.approx(c * alone)
    eng.close()


def test_moving_a_producers_simulator_state_to_another_device_costs_its_bytes_over_the_link_or_a_reset():
    """Physical model: a piece run on a lent device first moves its producer's envs' state there (its ``lead``: no
    step), ``state_bytes`` per env over ``link_gb_s``, or a reset when the calibration does not give the bytes; the
    next piece on that device moves nothing, one back on its own device moves it back, and borrowing is not worth a
    move that makes the piece end later."""
    cal = load_calibration("paper_gpu")
    push = cal.env["maniskill/pushcube-state"]
    sized = cal.model_copy(update={"env": {**cal.env, "maniskill/pushcube-state":
                                           push.model_copy(update={"state_bytes": 4_000_000})}})
    assert ServiceTimes(cal, 2.0).move_s("maniskill/pushcube-state", 8) == pytest.approx(push.reset_s / 2)  # rebuilt
    assert ServiceTimes(sized, 2.0, link_gb_s=16.0).move_s("maniskill/pushcube-state", 8) == \
        pytest.approx(4e6 * 8 / 16e9 / 2)  # 32 MB over 16 GB/s at k = 2
    assert EmulationSettings(calibration="paper_gpu").link_gb_s == pytest.approx(63.0)  # PCIe Gen5 x16, one way

    wall = Clock()
    lanes, lent, d = Lanes(1, now=wall), LentDevices(now=wall), "actor-0#0"
    lanes.place(0, 1.0)  # its own device busy for 1 s
    lent.lend([d], free_at=wall())
    wait, there, borrowed = lanes.place(0, 0.2, lent=lent, unit=0.1, move_s=0.05)
    assert borrowed and there.device == d and wait == 0
    assert (there.lead, there.seconds, there.end) == (pytest.approx(0.05), pytest.approx(0.25),
                                                      pytest.approx(wall() + 0.25))  # the move, then 2 steps
    _, again, borrowed = lanes.place(0, 0.2, lent=lent, unit=0.1, move_s=0.05, state_on=d)
    assert borrowed and again.lead == 0 and again.seconds == pytest.approx(0.2)  # its state is there already
    lent.reclaim([d], at=again.start + 0.15)  # taken back in its second step: the state comes home with the rest
    _, home, borrowed = lanes.place(0, 0.1, lent=lent, unit=0.1, move_s=0.05, state_on=d)
    assert not borrowed and home.lead == pytest.approx(0.05) and home.seconds == pytest.approx(0.15)
    lent.lend([d], free_at=wall())
    # its own device is busy for 1.15 s more, the lent one idle: a move of 2 s would end the piece later there
    _, stay, borrowed = lanes.place(0, 0.1, lent=lent, unit=0.1, move_s=2.0)
    assert not borrowed and stay.lead == 0
    # a piece taken back during its move runs no step: the move, once begun, ends; steps begun by then run
    piece = DevicePiece(d, 10.0, 0.35, unit=0.1, lead=0.05)
    assert piece.cut(10.02) == pytest.approx(10.05) and piece.ran == pytest.approx(0.05)
    piece = DevicePiece(d, 10.0, 0.35, unit=0.1, lead=0.05)
    assert piece.cut(10.1) == pytest.approx(10.15)  # its first step had begun


def test_cpu_physics_envs_step_on_host_cores_and_a_lent_gpu_gains_them_nothing():
    """Physical model: robosuite and LIBERO are CPU MuJoCo: their steps run on the simulator worker's host cores (one
    per env, ``cores_per_sim_device`` per device), never on a GPU lane or a lent GPU; a calibration that says
    otherwise is refused. A step waits, on the devices' clock, until as many cores as its envs are free."""
    from nexus.emulator.cores import HostCores
    from nexus.emulator.settings import CORES_PER_GPU

    times = EmulationSettings(calibration="paper_gpu").times()
    assert times.physics("robosuite/lift-state") == times.physics("libero/spatial") == "cpu"
    assert times.physics("maniskill/pushcube-state") == "gpu"
    assert times.physics("anything/else", simulator="libero") == "cpu"  # the catalog's simulator decides
    cal = load_calibration("paper_gpu")
    lift = cal.env["robosuite/lift-state"]
    with pytest.raises(ValueError, match="robosuite is CPU MuJoCo"):
        Calibration.model_validate({**cal.model_dump(), "env": {**cal.model_dump()["env"], "robosuite/lift-state":
                                                                {**lift.model_dump(), "physics": "gpu"}}})
    emu = EmulationSettings.model_validate(EMU)
    assert emu.cores_per_sim_device == CORES_PER_GPU == 14 and emu.host_cores(emu.sim_places) == 4 * 14

    wall = Clock()
    cores = HostCores(4, now=wall)
    assert cores.place(3, 1.0) == 0  # 3 envs, 3 cores, at once
    assert cores.place(2, 1.0) == pytest.approx(1.0)  # one core free: waits for the first step's end
    assert cores.place(1, 0.5) == 0  # ... while a one-env step takes the core left
    assert cores.place(8, 0.1, ahead=0.2) == pytest.approx(2.2)  # wider than the host: all its cores, when all free
    with pytest.raises(ValueError, match="at least one host core"):
        HostCores(0)


def test_an_engines_notice_of_a_forward_goes_one_way_to_the_simulator_workers_and_arrives_in_order():
    """``lend_inference``: an engine tells every simulator worker of each forward (``DeviceLender.preempt``) over a
    real TCP comm without waiting for it to be handled (a reply per forward cost both event loops a message): the
    notices return while the simulator worker's handler is still held, then arrive in order with what was sent; a
    worker without ``SIM`` hears nothing."""
    from nexus.emulator.lender import DeviceLender
    from tests.dask_servers import loopback_servers

    got: list[tuple] = []
    heard_elsewhere: list[str] = []
    engine_address: list[str] = []
    release, all_in = asyncio.Event(), asyncio.Event()

    async def nexus_preempt(device: str, at: float, seconds: float, share: float, owner: str) -> None:
        await release.wait()
        got.append((device, at, seconds, share, owner))
        if len(got) == 3:
            all_in.set()

    async def not_a_simulator(device: str, **_) -> None:
        heard_elsewhere.append(device)

    async def main() -> None:
        async with loopback_servers({"nexus_preempt": nexus_preempt},
                                    {"nexus_preempt": not_a_simulator}) as (pool, [sim, infer]):
            async def identity() -> dict:
                return {"workers": {sim.address: {"resources": {"SIM": 1}},
                                    infer.address: {"resources": {"INFER": 1}}}}

            engine_worker = SimpleNamespace(rpc=pool, scheduler=SimpleNamespace(identity=identity),
                                            address=infer.address)
            engine_address.append(infer.address)
            lender = DeviceLender()
            for i in range(3):  # each returns at once: the first one's handling is held until all three are sent
                await asyncio.wait_for(lender.preempt(engine_worker, "infer-0#0", 100.0 + i, 0.01, 0.5), 3)
            assert got == []
            release.set()
            await asyncio.wait_for(all_in.wait(), 3)

    asyncio.run(main())
    # with the engine's worker's address: the simulator worker tells it of the lent work it places there
    assert got == [("infer-0#0", 100.0 + i, 0.01, 0.5, engine_address[0]) for i in range(3)]
    assert heard_elsewhere == []


def test_a_producer_pushed_back_on_a_lent_device_sleeps_the_push_as_a_wait_for_the_device():
    lent, clock = LentDevices(), DeviceClock()
    lent.preempt("infer-0#0", at=time.time() - 1, seconds=0.0)
    piece = lent.take(time.time(), 1.0, before=time.time() + 3, unit=0.1)

    def sleep_on(timeout: float) -> tuple[float, float]:  # the engine's forward arrives while the producer sleeps
        threading.Thread(target=lambda: lent.preempt("infer-0#0", at=piece.start + 0.05, seconds=0.2)).start()
        return piece.wait_cut(timeout)

    assert clock.spend(1.0, cut=sleep_on) == pytest.approx(1.0)  # every step ran
    # heard while its producer slept on it: pushed back, not missed; the push is the device's wait, not owed time
    assert piece.pushed == pytest.approx(0.2) and piece.missed == 0 and piece.end == pytest.approx(piece.start + 1.2)
    assert clock.slept == pytest.approx(1.0) and clock.queued == pytest.approx(0.2) and clock.debt < 0.1


def test_a_producers_stepping_share_and_what_it_tells_its_device_lanes():
    from nexus.emulator.sim import producer_load
    from nexus.spec import TenantSpec

    cal = load_calibration("paper_gpu")
    one, ten = ServiceTimes(cal, 1.0), ServiceTimes(cal, 10.0)
    lift = one.stepping_share("robosuite/lift-state", 8, "oft")
    push = one.stepping_share("maniskill/pushcube-state", 8, "oft")
    assert 0 < push < lift < 1  # robosuite's long steps keep its device busier than ManiSkill's
    assert ten.stepping_share("robosuite/lift-state", 8, "oft") == pytest.approx(lift)  # a share: no k in it
    chunk = (0.030 + 0.004 * 8) * 8  # paper_gpu.toml: step_s + env_s * K per step, 8 steps per action chunk
    assert lift == pytest.approx(chunk / (chunk + 0.045 + 0.00298 * 8))  # ... over that and one forward of 8 rows
    assert one.family("maniskill/pickcube-rgb", "oft") == "oft" and one.family("x", "groot") == "groot"

    for env, placement, expected in (("maniskill/pushcube-state", "fewest", 0.0), ("maniskill/pushcube-state", "load",
                                                                                 push),
                                     ("robosuite/lift-state", "load", 0.0)):  # CPU MuJoCo: its GPU lane idle
        spec = TenantSpec(name="t", env=env, action_dim=7 if env.startswith("robosuite") else 4, hidden_dim=32)
        emu = EmulationSettings(calibration="paper_gpu", time_scale=10, sim_placement=placement)
        req = SimpleNamespace(env=spec.env, tenant=SimpleNamespace(spec=spec))
        assert producer_load(req, emu, emu.times(), 8) == pytest.approx(expected)
    with pytest.raises(ValueError, match="sim_placement"):
        EmulationSettings(calibration="paper_gpu", sim_placement="emptiest")


def test_an_emulated_engine_keeps_its_devices_clock_apart_from_the_hosts_time(tmp_path):
    from nexus.emulator.engine import EmulatedEngine

    eng = EmulatedEngine(ServiceConfig(root=str(tmp_path)), EmulationSettings.model_validate(EMU10))
    # the group wait T is a device time: divided by k inside, reported in emulated seconds
    assert eng.queue.batcher.max_wait_s == pytest.approx(ServiceConfig(root="/x").infer_max_wait_s / 10)
    assert eng.set_batching(0.02, 4) == {"max_wait_s": pytest.approx(0.02), "max_batch": 4}
    assert eng.queue.batcher.max_wait_s == pytest.approx(0.002)
    # a group starts on the device's timeline when it was ready (its last request in; its first one's T up when
    # it fired on time) or when the forward before ended, plus 1/k of the host's lateness beyond (k = 10 here)
    eng.timeline.free_at[0] = 100.0
    assert eng.queue.waits_of([101.0], 101.5, "all_waiting") == [pytest.approx(0.05)]  # the device was idle
    assert eng.queue.waits_of([101.0], 101.1, "timeout") == [pytest.approx(0.002 + 0.0098)]  # T: the device's
    assert eng.queue.waits_of([99.0], 101.5, "full") == [pytest.approx(1.15)]  # it arrived during a forward
    assert eng.queue.waits_of([99.9, 100.5], 101.5, "all_waiting") == [pytest.approx(0.7), pytest.approx(0.1)]
    assert eng._start == pytest.approx(100.6)
    assert eng.queue.waits_of([99.9], 99.95, "timeout") == [pytest.approx(0.1)]  # fired before T was up
    # a request counts from when it was made on the devices' clock: its arrival less its producer's host time still
    # owed (ahead); a producer's late message keeps neither the group's other requests nor the device waiting
    eng.timeline.free_at[0] = 100.0
    assert eng.queue.waits_of([101.0, 101.3], 101.5, "all_waiting", [0.0, 0.3]) == [pytest.approx(0.02)] * 2
    assert eng._start == pytest.approx(101.02)  # + 1/k of the host's lateness after the last request was in
    eng.timeline.free_at[0] = 100.0
    assert eng.queue.waits_of([101.0, 101.3], 101.5, "all_waiting") == [pytest.approx(0.32), pytest.approx(0.02)]
    eng.timeline.free_at[0] = 100.0
    assert eng.queue.waits_of([101.0], 101.1, "timeout", [0.5]) == [pytest.approx(0.002 + 0.0098)]
    assert eng._start == pytest.approx(100.5 + 0.002 + 0.0098)  # T from when it was made; lateness from the host's
    # the forward sleeps to the device's end: a group that started long ago on the device's clock sleeps nothing,
    # and the device's timeline moves by the calibrated time, not by the host's
    eng.heads.specs["a"] = (SimpleNamespace(env="maniskill/pushcube-state", action_head="oft"),
                            SimpleNamespace(action_dim=4))
    eng.heads.live["a"] = (3, None)
    eng.queue.waits_of([time.monotonic() - 5.0], time.monotonic(), "all_waiting")
    started = eng._start
    began = time.monotonic()
    outs = asyncio.run(eng._forward_group([SimpleNamespace(tenant="a", version=None)] * 2))
    assert [o["version"] for o in outs] == [3, 3]
    assert eng.timeline.free_at[0] == pytest.approx(started + eng._busy) and eng._busy > 0
    assert eng.timeline.free_at[0] < began  # it ended on the device before the host ran it: nothing to sleep
    assert eng.queue.compute_of(123.0) == eng._busy  # the compute a producer is told: the device's
    eng.close()


def test_the_producers_owed_host_time_and_the_actors_timeline_keep_the_devices_clock(tmp_path):
    from nexus.emulator.actor import UpdateTimeline
    from nexus.wire.messages import BatchRef

    # a producer's host time (messaging, a late timer) is paid out of its next sleeps, less the 1/k of it a run at
    # the devices' speed would see too (k = 4 here); at k = 1 all of it is the run's own
    clock = DeviceClock(4.0)
    clock.owe(0.004)
    assert clock.ask(0.004) == pytest.approx(0.001) and clock.ask(0.004) == pytest.approx(0.004)
    clock.owe(0.010)
    assert clock.ask(0.004) == 0.0 and clock.ask(0.004) == pytest.approx(0.0005)
    assert clock.slept == pytest.approx(0.016)
    one = DeviceClock()
    one.owe(5.0)
    assert one.debt == 0.0 and one.ask(0.004) == 0.004
    # so is its own loop between steps and requests (its locks, its share of the interpreter): what no message said
    host = Clock()
    loop = DeviceClock(4.0, now=host)
    host.advance(0.02)
    loop.settle()
    owed = loop.debt
    assert owed == pytest.approx(0.75 * 0.02)
    host.advance(0.02)
    loop.message(0.02, served=0.02)  # a round trip that was the engine's device time
    loop.settle()
    assert loop.debt == pytest.approx(owed)  # neither owed twice nor owed as the loop's
    # a request made earlier on the devices' clock by the debt (ahead) waited that long at the engine there: the
    # wait before its arrival pays the debt off, and only the host's messaging is owed
    paying = DeviceClock(4.0)
    paying.debt = 0.3
    paying.message(0.05, served=0.33, paid=0.3)  # 0.3 s of the engine's wait before it arrived, 0.03 after
    assert paying.debt == pytest.approx(0.02 * 0.75)  # the round trip's 0.02 s of messaging, less its 1/k
    paying.message(0.05, served=0.03)  # nothing owed when it was made: as before, the 0.02 s of messaging owed
    assert paying.debt == pytest.approx(2 * 0.02 * 0.75)
    # a batch split over rollout tasks ended when its last part did; what is not said stays 0
    parts = [BatchRef("a", 8, 1, 3, "t", ended_at=5.0), BatchRef("b", 8, 1, 2, "t", ended_at=7.0)]
    assert BatchRef.joined(parts).ended_at == 7.0
    assert BatchRef.from_dict({**parts[0].to_dict(), "ended_at": None}).ended_at == 0.0
    assert BatchRef.from_dict(BatchRef.joined(parts).to_dict()) == BatchRef.joined(parts)
    # a rollout task starts from the end of the batch or update that let it start, unless it waited for its place
    from nexus.control.dispatch.sim_share import WAITED_S, ready_from

    assert ready_from(100.0, 105.0, 105.0 + WAITED_S / 2) == 100.0  # granted at once: the host's dispatch is owed
    assert ready_from(100.0, 105.0, 107.0) == 107.0  # it waited 2 s for a simulator place: from the grant
    assert ready_from(0.0, 105.0, 107.0) == 0.0  # nothing said (a real service, an evaluation)
    # ... from when the place's last holder ended on the devices' clock, when that is known (not the host's grant)
    assert ready_from(100.0, 105.0, 107.0, freed_at=106.2) == 106.2
    assert ready_from(100.0, 105.0, 107.0, freed_at=99.0) == 100.0  # freed before this task was ready
    assert ready_from(100.0, 105.0, 105.0 + WAITED_S / 2, freed_at=104.0) == 100.0  # not waited for: unchanged
    # an update starts when its batch (or its job's update before) ended, unless its devices were still busy;
    # never after now, and at now when nothing is known
    wall = Clock()
    line = UpdateTimeline(2, k=10.0, now=wall)
    now = wall()
    assert line.start([0, 1], now - 0.5) == pytest.approx(now - 0.45)  # + 1/10 of the host's 0.5 s
    line.end([0, 1], now - 0.2, "j")
    assert line.start([0], now - 0.5) == pytest.approx(now - 0.18)  # its device ended later
    assert line.job_end == {"j": pytest.approx(now - 0.2)}
    assert line.start([1], now + 9.0) == now and line.start([1], 0.0) == now  # never after now; now when not known
    assert UpdateTimeline(1, now=wall).start([0], now - 0.5) == pytest.approx(now)  # k = 1: the host's is the run's


def test_an_emulated_engine_charges_each_forward_its_calibrated_time_one_after_the_other(tmp_path):
    from nexus.emulator.engine import EmulatedEngine
    from nexus.engine.queue import Group

    async def charge() -> tuple[list, float]:
        eng = EmulatedEngine(ServiceConfig(root=str(tmp_path)), EmulationSettings.model_validate(EMU10))
        rows = [SimpleNamespace(tenant="a", job="j")] * 2
        # a forward that paid the host's lateness back slept nothing: its device still worked the calibrated 4 ms
        eng._busy = 0.004
        eng._record(Group(rows, 1, "full", 0.0, 100.0, 100.0, [0.0, 0.0]))
        # the next one, woken late, slept 6 ms from before the first one's 4 ms were up: charged after them
        eng._busy = 0.004
        eng._record(Group(rows, 1, "full", 0.006, 100.001, 100.007, [0.0, 0.0]))
        # one long after: charged from its own start
        eng._record(Group(rows, 1, "full", 0.004, 200.0, 200.004, [0.0, 0.0]))
        spans, busy = list(eng.meter._signal["spans"]), eng.stats.busy_s
        eng.close()
        return spans, busy

    spans, busy = asyncio.run(charge())
    assert [s[:2] for s in spans] == [pytest.approx((100.0, 100.004)), pytest.approx((100.004, 100.008)),
                                      pytest.approx((200.0, 200.004))]
    assert busy == pytest.approx(0.012)


def test_critical_order_puts_unblocking_work_first_then_the_longest_remaining_chain():
    left = {"a": 3.0, "b": 30.0, "s": 100.0}
    q = TrainingQueue("critical", remaining=lambda t: left[t])
    for t in left:
        q.set_limits(t, TenantLimits(max_inflight=4))
    for t, kind in (("s", "sft"), ("a", "rl"), ("b", "rl"), ("s", "sft")):
        q.reserve(t)
        q.put(TrainingItem(tenant=t, kind=kind, policy_version=0))
    order = [q.pop({})[0].tenant for _ in range(4)]
    assert order == ["b", "a", "s", "s"]
    assert set(q.delay_view()) == {"a", "b", "s"}
    q.order = "fifo"
    q.reserve("s")
    q.put(TrainingItem(tenant="s", kind="sft", policy_version=0))
    assert q.pop({})[0].tenant == "s"


def test_a_tenants_simulator_work_left_is_its_rl_jobs_updates_left_at_their_metered_rate():
    from nexus.control.dispatch.adaptive import remaining_sim_s
    from nexus.control.jobs.state import JobStatus

    def job(job_id: str, kind: str, updates: int, done: int, state: JobStatus = JobStatus.RUNNING):
        return SimpleNamespace(job_id=job_id, state=state, spec=SimpleNamespace(kind=kind, updates=updates),
                               progress={"updates": done})

    jobs = SimpleNamespace(of_tenant=lambda t: {
        "a": [job("j1", "rl", 24, 4), job("j2", "sft", 0, 0), job("j3", "rl", 10, 2, JobStatus.DONE)],
        "b": [job("j4", "rl", 6, 0)]}.get(t, []))
    metered = {"j1": {"simulator": 8.0}, "j3": {"simulator": 100.0}}
    assert remaining_sim_s(jobs, metered, "a") == 20 * 2.0  # 20 updates left at 2 s each; ended and SFT jobs: none
    assert remaining_sim_s(jobs, metered, "b") == 6.0  # before its first update: 1 s each
    assert remaining_sim_s(jobs, metered, "c") == 0.0


def test_an_rl_batch_is_split_over_free_simulator_places_up_to_the_policy_and_one_wave_each():
    from nexus.config.service import DataPathSettings
    from nexus.control.dispatch.sim_share import SimSlots
    from nexus.control.jobs.flows import FlowContext

    cap = [8]
    slots = SimSlots(lambda: cap[0])
    ctx = FlowContext(None, None, None, None, None, 1, log=lambda *a: None,  # type: ignore[arg-type]
                      datapath=DataPathSettings(envs_per_producer=8), sim_slots=slots)
    push = "maniskill/pushcube-state"
    assert ctx.batch_split(1, 16, push) == 1  # the paper's policies: the job's own split
    ctx.rollout_split = 4
    assert ctx.batch_split(1, 16, push) == 2  # 16 episodes are two waves of 8 envs: 2 parts, not 4
    assert ctx.batch_split(1, 64, push) == 4  # 8 waves: the policy's 4
    assert ctx.batch_split(3, 16, push) == 3  # never below the job's own split
    slots._take("other")
    cap[0] = 2
    assert ctx.batch_split(1, 64, push) == 1  # one free place: no split
    cap[0] = 3
    assert ctx.batch_split(1, 64, push) == 2
    elastic = ServiceConfig(root=".", scheduler="elastic").dispatch
    ctx.follow(elastic)  # rule "always": the split no longer follows the moment's free places
    assert (ctx.rollout_split, ctx.rollout_split_rule, slots.order) == (4, "always", "fair")
    ctx.follow(elastic.model_copy(update={"sim_order": "critical"}))
    assert slots.order == "critical"
    cap[0] = 2
    assert ctx.batch_split(1, 64, push) == 4
    assert ctx.batch_split(1, 16, push) == 2  # still one wave each


# -- one emulated 2-2-4 service ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nx(tmp_path_factory):
    from nexus.emulator.service import local
    from nexus.spec import TenantSpec

    with local(tmp_path_factory.mktemp("emulated"), emulation=EMU, scheduler="fifo",
               datapath={"envs_per_producer": 4}) as nexus:
        for name, env, dim in (("emu-lift", "robosuite/lift-state", 7), ("emu-push", "maniskill/pushcube-state", 4)):
            nexus.create_tenant(TenantSpec(name=name, env=env, action_dim=dim, hidden_dim=32, seed=5))
        nexus.create_tenant(TenantSpec(name="emu-sft", dataset="pickcube-scripted", env="maniskill/pickcube-state",
                                       action_dim=4, hidden_dim=32, seed=6))
        yield nexus


def _run(nx, policy: str) -> tuple[float, float, dict]:
    from nexus.config.service import Scheduler

    nx.service.internal("nexus_set_scheduler", scheduler=Scheduler.load(policy).model_dump())
    t0 = time.time()
    handles = {"emu-lift": nx.tenant("emu-lift").rl(updates=2, episodes_per_batch=4, collectors=2),
               "emu-push": nx.tenant("emu-push").rl(updates=2, episodes_per_batch=4, collectors=2),
               "emu-sft": nx.tenant("emu-sft").sft(steps=4, batch_size=64)}
    results = {n: h.result(timeout=600) for n, h in handles.items()}
    t1 = time.time()
    nx.flush()
    return t0, t1, {"results": results, "views": {n: h.info() for n, h in handles.items()}}


def _outcome(res: dict) -> dict:
    keep = ("version", "updates", "episodes", "env_steps", "requests", "rows", "mean_return", "return",
            "success_rate", "steps", "dropped_stale")
    return {n: {k: v for k, v in r.items() if k in keep} for n, r in res["results"].items()}


def test_emulated_service_runs_the_real_plugin_and_accounts_per_device(nx):
    info = nx.service.client.scheduler_info()["workers"]
    resources = sorted(tuple(sorted(i["resources"].items())) for i in info.values())
    # one worker per service holding its devices, and the tracker's own (cluster.tracker_worker: an emulated
    # service's default)
    assert resources == [(("ACTOR", 2), ("DEVICES", 2)), (("DEVICES", 2), ("INFER", 2)), (("DEVICES", 4), ("SIM", 4)),
                         (("TRACK", 1),)], info

    def plugin_kind(dask_scheduler):
        p = dask_scheduler.plugins["nexus"]
        return type(p).__module__, type(p.master.queue).__module__, type(p.master.pool).__module__

    assert nx.service.client.run_on_scheduler(plugin_kind) == (
        # no second scheduler
        "nexus.control.plugin", "nexus.control.dispatch.training_queue", "nexus.control.health.engine_pool")

    def host_kind(dask_worker):
        p = dask_worker.plugins["nexus"]
        return type(p.actor).__name__ if p.actor is not None else [type(e.engine).__name__ for e in p.engines.values()]

    kinds = sorted(str(v) for v in nx.service.client.run(host_kind).values())
    assert "EmulatedActorHost" in kinds and "['EmulatedEngine', 'EmulatedEngine']" in kinds

    def seam(dask_worker):  # each worker's devices are the emulator's, installed in the one seam by its preload
        from nexus.wire import devices

        return type(devices.installed()).__module__

    assert set(nx.service.client.run(seam).values()) == {"nexus.emulator.worker"}
    assert (nx.service.root / "emulator.json").exists() and "emulation" not in nx.service.config.model_dump()

    t0, t1, res = _run(nx, "fifo")
    out = _outcome(res)
    assert out["emu-lift"]["updates"] == 2 and out["emu-sft"]["steps"] == 4
    assert out["emu-lift"]["env_steps"] == 2 * 4 * 240  # the calibration's episode length
    assert out["emu-lift"]["requests"] == 2 * 240 // 8  # one action request per chunk of 8 steps (K=4 in one)
    # the tracker's host work (MLflow, plots) stayed off the workers carrying the emulated devices: on its own
    # worker, which the OS runs after theirs
    assert {r["role"]: r for r in nx.status()["roles"]}["tracker"]["worker"] == "tracker-0"
    nice = {info[a]["name"]: n for a, n in nx.service.client.run(os.getpriority, os.PRIO_PROCESS, 0).items()}
    assert nice["tracker-0"] == min(nice["actor-0"] + TRACKER_NICE, 19) and nice["actor-0"] == nice["infer-0"], nice
    st = nx.status(limit=100)
    assert set(st["training_queue"]["delay_s"]) >= {"emu-lift", "emu-push", "emu-sft"}  # the real queue ran them
    reasons = {}
    for i in range(2):
        reasons.update(nx.service.engine(i).engine_stats().result()["reasons"])
    assert reasons and set(reasons) <= {"full", "all_waiting", "none_expected", "timeout"}  # the real batcher

    acc = nx.service.internal("nexus_accounting", t0=t0, t1=t1)
    assert {s: r["slots"] for s, r in acc["services"].items()} == {"actor": 2, "inference": 2, "simulator": 4}
    for service, row in acc["services"].items():
        assert row["device_s"] == pytest.approx(row["slots"] * acc["wall_s"])
        assert all(0 <= b <= acc["wall_s"] + 1e-6 for b in row["busy_per_slot_s"].values()), row
        assert 0.0 < row["utilization"] <= 1.0, (service, row)
    # an update holds the whole actor group (2 devices, data-parallel): both are charged the same
    a = acc["services"]["actor"]["busy_per_slot_s"]
    assert a["actor-0#0"] == pytest.approx(a["actor-0#1"], rel=0.05)


def test_a_short_emulated_run_is_deterministic_for_a_fixed_seed(nx):
    """The same jobs of fresh tenants with the same seeds, run twice (at the same time, sharing the devices):
    versions, episodes, steps, action requests and the drawn returns and successes are identical."""
    from nexus.spec import TenantSpec

    outs = {}
    handles = {}
    for run in ("a", "b"):
        for env, dim in (("robosuite/lift-state", 7), ("maniskill/pushcube-state", 4)):
            name = f"det-{run}-{env.split('/')[0]}"
            nx.create_tenant(TenantSpec(name=name, env=env, action_dim=dim, hidden_dim=32, seed=9))
            handles[name] = nx.tenant(name).rl(updates=2, episodes_per_batch=4, collectors=2)
    for name, h in handles.items():
        out = _outcome({"results": {name: h.result(timeout=600)}})[name]
        # a job's 'return' / 'success_rate' are its last batch's, and which of the two collectors' batches
        # comes last is a matter of timing: the batches' draws are compared as a set, the totals as they are
        last = {k: out.pop(k) for k in ("return", "mean_return", "success_rate") if k in out}
        history = nx.tenant_log(name)["jobs"][0]["history"]
        batches = sorted((h["return"], h["success_rate"]) for h in history if h["kind"] == "rollout")
        assert (last["return"], last["success_rate"]) in batches
        outs[name] = {**out, "batches": batches}
    for sim in ("robosuite", "maniskill"):
        a, b = outs[f"det-a-{sim}"], outs[f"det-b-{sim}"]
        assert a == b, (a, b)
        assert a["version"] == 2 and a["episodes"] == 8 and len(a["batches"]) == 2


def test_the_isolated_policy_really_isolates_on_emulated_devices(nx):
    t0, _, res = _run(nx, "isolated")
    views = sorted(res["views"].values(), key=lambda v: v["t_start"])
    for a, b in itertools.pairwise(views):
        assert a["t_end"] <= b["t_start"] + 1e-3, (a, b)  # one tenant after the other
    spans = [s for s in nx.monitoring(since=t0)["spans"] if s["t0"] >= t0]
    assert all("+" not in s["tenant"] for s in spans)  # no forward mixed two tenants
    by_tenant = {tn: [s for s in spans if s["tenant"] == tn] for tn in {s["tenant"] for s in spans}}
    assert set(by_tenant) == {"emu-lift", "emu-push", "emu-sft"}
    for x, y in itertools.combinations(by_tenant, 2):
        for p, q in itertools.product(by_tenant[x], by_tenant[y]):
            assert p["t1"] <= q["t0"] + 1e-3 or q["t1"] <= p["t0"] + 1e-3, (p, q)


def test_the_elastic_policy_splits_an_rl_batch_over_simulators_and_keeps_its_episodes(nx):
    """One RL batch of 8 episodes (K = 4 envs a producer): one rollout task under ``priority``, two at once under
    ``elastic`` (on two of the 2-2-4 service's 4 simulator devices); the same episodes either way."""
    from nexus.config.service import Scheduler

    got = {}
    for pol in ("priority", "elastic"):
        nx.service.internal("nexus_set_scheduler", scheduler=Scheduler.load(pol).model_dump())
        t0 = time.time()
        out = nx.tenant("emu-push").rl(updates=1, episodes_per_batch=8, collectors=1).result(timeout=300)
        nx.flush()
        spans = [s for s in nx.monitoring(since=t0)["spans"]
                 if s["service"] == "simulator" and s["t0"] >= t0 - 1e-3]
        got[pol] = (out["episodes"], out["env_steps"], len(spans), spans)
    assert got["priority"][:3] == (8, 800, 1)
    assert got["elastic"][:3] == (8, 800, 2)
    a, b = got["elastic"][3]
    assert a["worker"] != b["worker"] and a["t0"] < b["t1"] and b["t0"] < a["t1"]  # two devices at once


def test_the_trackers_own_worker_lost_mid_job_is_waited_for_and_the_jobs_run_keeps_every_update(nx):
    """The tracker's own worker killed while an RL job runs: the tracker starts again on that worker once its nanny
    has restarted it (not on a device's worker meanwhile), and the job's MLflow run ends with each update's metrics
    (the control plane's link resends what the lost tracker had not acknowledged)."""
    from mlflow.tracking import MlflowClient

    from nexus.client.faults import kill_worker, wait_for
    from nexus.control.health.supervisor import TRACKER_GRACE_S

    def tracker() -> dict:
        return {r["role"]: r for r in nx.status()["roles"]}["tracker"]

    # past the boot's grace period: a tracker without a worker of its role could go to any worker now
    time.sleep(max(0.0, nx.status()["service"]["boot_time"] + TRACKER_GRACE_S + 1 - time.time()))
    restarts = tracker()["restarts"]
    job = nx.tenant("emu-push").rl(updates=3, episodes_per_batch=4, collectors=2)
    kill_worker(nx, "tracker-0")
    wait_for(lambda: tracker()["state"] != "healthy", 60, 0.1, "the tracker seen as lost")
    assert job.result(timeout=600)["updates"] == 3
    back = wait_for(lambda: (t := tracker())["state"] == "healthy" and t, 120, 0.2, "the tracker restarted")
    assert back["worker"] == "tracker-0" and back["restarts"] == restarts + 1, back
    nx.flush()
    cfg = nx.service.config
    client = MlflowClient(tracking_uri=cfg.resolved_tracking_uri())
    exp = client.get_experiment_by_name(cfg.resolved_experiment())
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`nexus.job` = '{job.id}'")
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "system/update_s"))
    assert len(steps) == 3 and len(set(steps)) == 3, steps


def test_the_emulators_up_refuses_bad_input_in_one_line_and_creates_nothing(tmp_path):
    """``python -m nexus.emulator up --emulate CALIBRATION`` is the switch; ``nexus up`` knows no emulator flag."""
    import subprocess
    import sys

    root = tmp_path / "svc"
    for args, needle in ((["--emulate", "no-such-calibration"], "calibrations/ has: "),
                         (["--emulate", "paper_gpu", "--devices", "2-2"], "actor-inference-simulator"),
                         (["--emulate", "paper_gpu", "--time-scale", "0"], "time_scale")):
        r = subprocess.run([sys.executable, "-m", "nexus.emulator", "up", "--root", str(root), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not root.exists()
    for cmd in (["nexus.emulator", "up", "--root", str(root)],  # no calibration
                ["nexus.client.cli", "up", "--root", str(root), "--emulate", "paper_gpu"]):  # not the service's
        r = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "--emulate" in r.stderr, r.stderr
        assert not root.exists()


def test_a_simulator_device_shared_by_two_producers_steps_one_at_a_time(tmp_path):
    """``producers_per_sim = 2`` on one simulator device: an RL job's two producers hold it at once (the SIM
    resource counts producer places, the accounting one device), and their steps take turns on it (GPU physics:
    ManiSkill; a CPU-physics env steps on host cores instead)."""
    from nexus.emulator.service import local
    from nexus.spec import TenantSpec

    emu = {**EMU, "devices": {"actor": 1, "inference": 1, "simulator": 1}, "producers_per_sim": 2}
    with local(tmp_path / "svc", emulation=emu, scheduler="fifo", datapath={"envs_per_producer": 4}) as nx:
        info = nx.service.client.scheduler_info()["workers"]
        assert sorted(tuple(sorted(i["resources"].items())) for i in info.values()) == [
            (("ACTOR", 1),), (("INFER", 1),), (("SIM", 2),), (("TRACK", 1),)]
        nx.create_tenant(TenantSpec(name="pair", env="maniskill/pushcube-state", action_dim=4, hidden_dim=32,
                                    seed=3))
        t0 = time.time()
        out = nx.tenant("pair").rl(updates=2, episodes_per_batch=4, collectors=2).result(timeout=300)
        t1 = time.time()
        nx.flush()
        assert out["episodes"] == 8
        acc = nx.service.internal("nexus_accounting", t0=t0, t1=t1)
        sim = acc["services"]["simulator"]
        assert sim["slots"] == 1 and list(sim["busy_per_slot_s"]) == ["sim-0"], sim  # one device, not two
        rollouts = [s for s in nx.monitoring(since=t0)["spans"]
                    if s["service"] == "simulator" and s["t0"] >= t0 - 1e-3]
        assert len(rollouts) == 2 and len({s["worker"] for s in rollouts}) == 1, rollouts  # sim-0's address
        a, b = sorted(rollouts, key=lambda s: s["t0"])
        assert b["t0"] < a["t1"], (a, b)  # both producers held the device at once
        # ... but it stepped one of them at a time: together they lasted at least their stepping summed (sharing
        # without turns would step both at once, in about half of it)
        held = max(a["t1"], b["t1"]) - a["t0"]
        assert held >= 0.95 * (a["sim_s"] + b["sim_s"]), (held, a, b)


@pytest.mark.parametrize("lends", ["lend_actor", "lend_inference"])
def test_an_idle_actor_or_engine_lends_its_device_to_a_busy_simulator_and_keeps_its_own_work_first(tmp_path, lends):
    """``lend_actor``: two producers on one simulator device step on the actor's device too while no update runs
    there (their pieces say how much ran there), and the actor's updates are charged to the actor alone;
    ``lend_inference``: the same on the engine's device between its forwards, charged to the engine alone. A GPU
    env whose state is small (moved over the link in microseconds) borrows; a CPU-physics env never does."""
    from nexus.emulator.service import local
    from nexus.spec import TenantSpec

    cal = load_calibration("paper_gpu").model_dump()
    # a GPU env with steps as long as robosuite's (so two producers' chunks overlap) and a small state
    cal["env"]["maniskill/pushcube-state"].update(step_s=0.030, env_s=0.004, state_bytes=10_000)
    emu = {**EMU, "devices": {"actor": 1, "inference": 1, "simulator": 1}, "producers_per_sim": 2, lends: True,
           "table": cal}
    with local(tmp_path / "svc", emulation=emu, scheduler="fifo", datapath={"envs_per_producer": 4}) as nx:
        nx.create_tenant(TenantSpec(name="lender", env="maniskill/pushcube-state", action_dim=4, hidden_dim=32,
                                    seed=3))
        t0 = time.time()
        out = nx.tenant("lender").rl(updates=4, episodes_per_batch=4, collectors=2).result(timeout=300)
        t1 = time.time()
        nx.flush()
        assert out["updates"] == 4 and out["episodes"] == 16
        spans = [s for s in nx.monitoring(since=t0)["spans"] if s["t0"] >= t0 - 1e-3]
        rollouts = [s for s in spans if s["service"] == "simulator"]
        actor = [s for s in spans if s["service"] == "actor"]  # the updates, the job's checkpoint and last sync
        lent = sum(s["lent_s"] for s in rollouts)
        assert sum(s["what"] == "rl" for s in actor) == 4 and 0 < lent < sum(s["sim_s"] for s in rollouts), rollouts
        acc = nx.service.internal("nexus_accounting", t0=t0, t1=t1)
        assert acc["services"]["actor"]["busy_s"] == pytest.approx(sum(s["t1"] - s["t0"] for s in actor), rel=1e-6)
        assert acc["services"]["simulator"]["slots"] == 1  # the lent device is still the actor's or engine's slot
        forwards = [s for s in spans if s["service"] == "inference"]
        assert acc["services"]["inference"]["busy_s"] == pytest.approx(sum(s["t1"] - s["t0"] for s in forwards),
                                                                         rel=1e-6)
        # CPU MuJoCo: its steps take host cores; a lent GPU gains it nothing, so none of them runs there
        nx.create_tenant(TenantSpec(name="mujoco", env="robosuite/lift-state", action_dim=7, hidden_dim=32, seed=3))
        t2 = time.time()
        assert nx.tenant("mujoco").rl(updates=1, episodes_per_batch=4, collectors=2).result(timeout=300)["updates"] == 1
        nx.flush()
        cpu = [s for s in nx.monitoring(since=t2)["spans"] if s["service"] == "simulator" and s["tenant"] == "mujoco"]
        assert cpu and all(s["lent_s"] == 0 and s["sim_s"] > 0 for s in cpu), cpu

