"""Schedule cache (fxpipe.schedule.cache, OptPipe Section 4.2): nearby problems hit, other
problems miss, hits are re-timed and valid for the new problem, entries are JSON."""

from __future__ import annotations

import json

import pytest

from fxpipe.errors import InputError
from fxpipe.ir import Schedule, ScheduleProblem
from fxpipe.schedule import heuristics
from fxpipe.schedule.cache import CACHE_FORMAT, ScheduleCache, solve_cached
from fxpipe.schedule.validate import check_schedule, peak_memory


def _problem(scale=1.0, **kw) -> ScheduleProblem:
    base = dict(num_stages=3, num_microbatches=4, t_f=[1.0 * scale, 1.1, 0.9], t_b=[1.3, 1.2 * scale, 1.25],
                t_w=[0.7, 0.8, 0.75 * scale], t_comm=0.05, t_offload=0.4, mem_f=1.0, mem_b=-0.5, mem_w=-0.5,
                mem_limit=2.0)
    base.update(kw)
    return ScheduleProblem.create(**base)


def test_perturbed_problem_hits_and_different_problem_misses(tmp_path):
    cache = ScheduleCache(tmp_path)
    p = _problem()
    sched = heuristics.generate(p, "adaoffload")
    path = cache.put(p, sched)
    assert path.exists()
    # 0.4% profiling noise on some times and 0.3% on the limit: same signature, a hit
    noisy = _problem(scale=1.004, mem_limit=2.006)
    assert cache.distance(cache.signature(noisy), cache.signature(p)) <= 1
    hit = cache.get(noisy)
    assert hit is not None
    assert hit.method == "cache"
    assert check_schedule(noisy, hit.ops) == []
    # the hit is re-timed with the new durations
    f0 = [o for o in hit.ops if o.stage == 0 and o.type == "F" and o.microbatch == 0][0]
    assert f0.end_s - f0.start_s == pytest.approx(1.004)
    # a different problem (times 30% off, other limit, other micro-batch count) misses
    assert cache.distance(cache.signature(_problem(scale=1.3)), cache.signature(p)) > 1
    assert cache.get(_problem(scale=1.3)) is None
    assert cache.get(_problem(mem_limit=3.0)) is None
    assert cache.get(_problem(num_microbatches=5)) is None


def test_entries_are_json_with_problem_and_schedule(tmp_path):
    cache = ScheduleCache(tmp_path)
    p = _problem()
    path = cache.put(p, heuristics.generate(p, "pipeoffload"))
    doc = json.loads(path.read_text())
    assert doc["format"] == CACHE_FORMAT
    assert doc["schedule"]["format"] == "fxpipe.schedule/1"
    assert doc["problem"]["format"] == "fxpipe.schedproblem/1"
    assert ScheduleProblem.from_dict(doc["problem"]).to_dict() == p.to_dict()
    Schedule.from_dict(doc["schedule"])
    assert not list(tmp_path.glob("*.tmp"))


def test_invalid_schedule_is_refused_and_broken_entry_is_a_miss(tmp_path):
    cache = ScheduleCache(tmp_path)
    p = _problem()
    sched = heuristics.generate(p, "pipeoffload")
    bad = Schedule(ops=sched.ops[1:], makespan=sched.makespan, stage_span=sched.stage_span)
    with pytest.raises(InputError):
        cache.put(p, bad)
    cache.path(p).parent.mkdir(parents=True, exist_ok=True)
    cache.path(p).write_text("{not json")
    assert cache.get(p) is None


def test_replay_that_breaks_memory_is_a_miss(tmp_path):
    cache = ScheduleCache(tmp_path, grid=0.5)  # coarse grid: limits 2.0 and 1.6 share a bin
    p = _problem(mem_limit=2.0, t_offload=0.0, offload_bytes=0.0)
    sched = heuristics.generate(p, "zb-h1")
    cache.put(p, sched)
    peak = float(peak_memory(p, sched.ops).max())
    tighter = _problem(mem_limit=1.6, t_offload=0.0, offload_bytes=0.0)
    assert cache.signature(tighter) == cache.signature(p)
    assert peak > 1.6  # the cached orders need more than the new limit, without offloads
    assert cache.get(tighter) is None


def test_solve_cached_uses_and_fills_the_cache(tmp_path):
    cache = ScheduleCache(tmp_path)
    small = dict(num_stages=2, num_microbatches=3, t_f=[1.0, 1.1], t_b=[1.3, 1.2], t_w=[0.7, 0.8])
    p = _problem(**small)
    first = solve_cached(p, cache, time_limit_s=10)
    assert first.meta["cache"] == "miss"
    assert check_schedule(p, first.ops) == []
    again = solve_cached(p, cache, time_limit_s=10)
    assert again.meta["cache"] == "hit"
    assert again.value == pytest.approx(first.value)
    noisy = _problem(**{**small, "t_f": [1.003, 1.1], "t_w": [0.7, 0.802]})
    third = solve_cached(noisy, cache, time_limit_s=10)
    assert third.meta["cache"] == "hit"
    assert check_schedule(noisy, third.ops) == []


def test_bad_arguments(tmp_path):
    with pytest.raises(InputError):
        ScheduleCache(tmp_path, grid=0)
    with pytest.raises(InputError):
        ScheduleCache(tmp_path).signature({"num_stages": 1})
    with pytest.raises(InputError):
        solve_cached(_problem(), object())
