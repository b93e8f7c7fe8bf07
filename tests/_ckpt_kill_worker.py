"""Kill the ranks of a 2-rank gloo job in every phase of ``save_training_state`` (issue 30, item 5).

Usage: ``python tests/_ckpt_kill_worker.py SPEC.json REPORT.json``. SPEC: ``{"dir": folder to work in,
"kills": "phases" | "all", "cases": bool}``. One process imports torch and compiles a 2-stage pipeline plan once;
every job forks two fresh ranks (a gloo group over a FileStore), so that a trial costs no interpreter
start. The armed rank counts its file-system writes with an audit hook (``open`` for writing,
``os.mkdir``, ``os.rename`` / ``os.replace``, ``os.remove``, ``os.rmdir``, ``shutil.rmtree``) and sends
itself SIGKILL just before the k-th; the parent then SIGKILLs the other rank.

1. Reference: train 2 AdamW steps, saving after each into one directory (the second save counted,
   each rank's writes listed: the phases), and dump the loaded state of each committed version.
2. Trials (one directory for all, as a job that keeps crashing would leave it): each loads what the
   previous trial left, dumps it, resets to the initial state, trains a step, saves (committed), trains
   a step and saves again with the kill armed. The committed version after a kill must load and equal
   step 1 (kill before the commit) or step 2 (after), byte for byte in tensors; at most two versions
   (the committed one and the killed save's) may remain.

3. With ``cases``: damaged copies of the reference's checkpoint (a missing ``optimizer/``, truncated,
   empty and garbage safetensors files, a missing key, another shape or dtype, out-of-range fields of the
   JSON record, a bad pointer, a save never committed) are loaded on both ranks in one process group
   (issue 30, item 6): each must raise InputError on both, and no rank may hang.

The report lists, per trial, the killed rank, the write it died before, the step loaded after it and
whether every tensor equalled the reference's; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

torch.set_num_threads(1)  # no OpenMP pool in the parent: fork-safe

import torch.distributed as dist  # noqa: E402

import fxpipe  # noqa: E402
from fxpipe.codegen.checkpoint import load_training_state, rank_state, save_training_state  # noqa: E402


def _committed(path: Path) -> Path | None:
    """The folder of the committed state: the version latest.json names; the directory itself in the first
    layout (fxpipe before issue 30, so that this harness shows what it did); None when there is none."""
    try:
        from fxpipe.codegen.checkpoint import latest_state_dir
    except ImportError:
        return path if (path / "fxpipe_state.json").is_file() else None
    return latest_state_dir(path)

WRITE_EVENTS = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _is_write(event: str, args) -> bool:
    if event in WRITE_EVENTS:
        return True
    if event != "open":
        return False
    mode, flags = (args[1], args[2]) if len(args) >= 3 else (None, 0)
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(isinstance(flags, int) and flags & WRITE_FLAGS)


def _describe(event: str, args, work: str) -> str:
    """The write as the same text in every run: the checkpoint folder, versions and temporary names replaced."""
    where = str(args[0]) if args else ""
    if where.startswith(work + os.sep):
        parts = where[len(work) + 1:].split(os.sep)
        where = os.sep.join(["CKPT"] + parts[1:])
    where = re.sub(r"step(\d+)-\d+-\d+", r"step\1-VERSION", where)
    where = re.sub(r"\.(\w+\.json)\.\w+\.tmp$", r".\1.TMP.tmp", where)
    return f"{event} {where}"


class Writes:
    """Audit hook of one rank: lists its file-system writes once armed; SIGKILL just before the
    ``occurrence``-th write described as ``target``."""

    def __init__(self, work: str):
        self.work = work
        self.armed = False
        self.target: tuple[str, int] | None = None
        self.seen: list[str] = []
        sys.addaudithook(self)

    def __call__(self, event: str, args) -> None:
        if not self.armed or not _is_write(event, args):
            return
        desc = _describe(event, args, self.work)
        if self.target is not None and desc == self.target[0] and self.seen.count(desc) == self.target[1]:
            os.kill(os.getpid(), signal.SIGKILL)
        self.seen.append(desc)


def _model_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    return model, torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


MODEL, X = _model_and_input()
PLAN = fxpipe.compile(MODEL, (X[:1],), devices=2, microbatches=2, mesh={"pp": 2}, schedule="1f1b", time_limit_s=0.2,
                      seed=0)
TARGET = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))


def _mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _build(rank: int):
    _, schedule = PLAN.build(rank, loss_fn=_mse)
    opt = torch.optim.AdamW(schedule.parameters(), lr=0.01, weight_decay=0.1)
    return schedule, opt


def _step(schedule, opt) -> None:
    opt.zero_grad()
    schedule.step(X, target=TARGET, losses=[])
    opt.step()


def _dump(schedule, opt, path: Path) -> None:
    """This rank's parameters and optimizer state (safetensors) for the parent to compare."""
    from safetensors.torch import save_file

    names = {id(t): k for k, t in rank_state(schedule).items()}
    out = {f"param/{k}": t.detach().clone().contiguous() for k, t in rank_state(schedule).items()}
    for p, st in opt.state.items():
        for name, v in st.items():
            out[f"optim/{names[id(p)]}/{name}"] = v.detach().clone().reshape(v.shape).contiguous()
    save_file(out, str(path))


def _load_cases(rank: int, job: dict) -> None:
    """Load every damaged checkpoint in one process group: each must raise InputError on both ranks."""
    schedule, opt = _build(rank)
    _step(schedule, opt)  # the optimizer has state, as when resuming
    got = {}
    for name in job["cases"]:
        try:
            load_training_state(Path(job["cases_dir"]) / name, schedule, opt)
            got[name] = ["(loaded)", ""]
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            got[name] = [type(exc).__name__, str(exc)]
    (Path(job["out"]) / f"cases-rank{rank}.json").write_text(json.dumps(got))


def _job(rank: int, job: dict, writes: Writes) -> None:
    out = Path(job["out"])
    if job.get("cases"):
        return _load_cases(rank, job)
    schedule, opt = _build(rank)
    ckpt = Path(job["ckpt"])
    if job.get("load_first"):  # what the previous trial left
        load_training_state(ckpt, schedule, opt)
        _dump(schedule, opt, out / f"{job['name']}-loaded-rank{rank}.safetensors")
        load_training_state(job["initial"], schedule, opt)  # back to the initial state (and no optimizer state)
    else:
        save_training_state(job["initial"], schedule, opt, step=0)
    _step(schedule, opt)
    save_training_state(ckpt, schedule, opt, step=1)
    if job.get("dump_refs"):
        save_training_state(job["step1"], schedule, opt, step=1)
    _step(schedule, opt)
    writes.armed = True
    if job.get("kill_rank") == rank:
        writes.target = (job["kill_write"], job["occurrence"])
    save_training_state(ckpt, schedule, opt, step=2)
    writes.armed = False
    (out / f"{job['name']}-writes-rank{rank}.json").write_text(json.dumps(writes.seen))
    if job.get("dump_refs"):  # each committed version as it loads
        for step, where in ((2, ckpt), (1, job["step1"])):
            load_training_state(where, schedule, opt)
            _dump(schedule, opt, out / f"ref-step{step}-rank{rank}.safetensors")


def _run(job: dict, timeout_s: float = 120.0) -> dict:
    """Fork two ranks for ``job``; returns how each ended (exit code or signal)."""
    store = Path(job["out"]) / f"{job['name']}.store"
    store.unlink(missing_ok=True)
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                writes = Writes(str(Path(job["ckpt"]).parent))
                dist.init_process_group("gloo", store=dist.FileStore(str(store), 2), rank=rank, world_size=2)
                _job(rank, job, writes)
                dist.destroy_process_group()
            except BaseException:  # noqa: BLE001 - reported through the exit code
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    ended: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(ended) < 2:
        for rank, pid in enumerate(pids):
            if rank in ended:
                continue
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                ended[rank] = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                               else f"exit {os.WEXITSTATUS(status)}")
                if os.WIFSIGNALED(status):  # the armed rank died: kill its peer now
                    for other, opid in enumerate(pids):
                        if other not in ended:
                            os.kill(opid, signal.SIGKILL)
        if time.monotonic() > deadline:
            for other, opid in enumerate(pids):
                if other not in ended:
                    os.kill(opid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.01)
    return {r: ended[r] for r in range(2)}


def _tensors(path: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


def _equal(a: dict, b: dict) -> bool:
    import numpy as np

    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _rewrite(path: Path, edit) -> None:
    """Rewrite one safetensors file with ``edit(tensors)`` applied, its metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata=meta)


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))  # NaN written as NaN, as a hand edit could


#: damaged copies of a committed checkpoint (issue 30, item 6): name -> (damage, words the error must hold)
def _cases() -> dict:
    def model_file(v):
        return v / "model" / "model-00001-of-00001.safetensors"

    def optim_file(v):
        return sorted((v / "optimizer").glob("*.safetensors"))[0]

    def setting(name, value):
        return lambda v: _edit_json(v / "fxpipe_state.json", lambda d: d["param_groups"]["0.weight"].__setitem__(name, value))

    def field(name, value):
        return lambda v: _edit_json(v / "fxpipe_state.json", lambda d: d.__setitem__(name, value))

    return {
        "no-optimizer": (lambda v: shutil.rmtree(v / "optimizer"), ["optimizer state folder", "does not exist"]),
        "truncated-model": (lambda v: model_file(v).write_bytes(model_file(v).read_bytes()[:200]),
                            ["model-00001-of-00001.safetensors cannot be read", "truncated"]),
        "empty-model": (lambda v: model_file(v).write_bytes(b""), ["model-00001-of-00001.safetensors cannot be read"]),
        "garbage-optimizer": (lambda v: optim_file(v).write_bytes(os.urandom(300)),
                              ["/optimizer/shard-", "cannot be read"]),
        "missing-key": (lambda v: _rewrite(model_file(v), lambda t: t.pop("2.weight")),
                        ["lacks 1 tensor(s) of this rank's stages: 2.weight", "/model"]),
        "wrong-shape": (lambda v: _rewrite(model_file(v), lambda t: t.__setitem__("2.bias", torch.zeros(3))),
                        ["2.bias stored (3,), this rank's is (16,)"]),
        "int-for-float": (lambda v: _rewrite(model_file(v), lambda t: t.__setitem__("4.bias", t["4.bias"].long())),
                          ["4.bias stored I64, this rank's is float32"]),
        "optimizer-shape": (lambda v: _rewrite(optim_file(v), lambda t: t.__setitem__(
            next(k for k in t if k.endswith("exp_avg")), torch.zeros(2, 2))), ["cannot load the optimizer state from"]),
        "lr-nan": (setting("lr", float("nan")), ["field 'param_groups['0.weight'].lr' is nan", "[0, 100]"]),
        "lr-negative": (setting("lr", -1), ["field 'param_groups['0.weight'].lr' is -1"]),
        "lr-huge": (setting("lr", 1e30), ["field 'param_groups['0.weight'].lr' is 1e+30"]),
        "step-negative": (field("step", -5), ["field 'step' is -5", "integer >= 0"]),
        "step-text": (field("step", "two"), ["field 'step' is 'two'"]),
        "step-nan": (field("step", float("nan")), ["field 'step' is nan"]),
        "groups-list": (field("param_groups", [{"lr": 0.01}]), ["field 'param_groups' is [", "an object"]),
        "pointer-missing-version": (lambda v: _edit_json(v.parent / "latest.json",
                                                         lambda d: d.__setitem__("version", "step9-1-1")),
                                    ["latest.json names version 'step9-1-1'"]),
        "pointer-garbage": (lambda v: (v.parent / "latest.json").write_text("{"), ["latest.json", "not valid JSON"]),
        "never-committed": (lambda v: (v.parent / "latest.json").unlink(), ["never committed"]),
    }


def _bad_checkpoints(work: Path, out: Path) -> dict:
    """Load each damaged copy of the reference's committed checkpoint on 2 ranks: (per rank: error type, message)."""
    cases_dir = work / "cases"
    cases = _cases()
    damaged = {}
    for name, (damage, _) in cases.items():
        shutil.copytree(work / "ref", cases_dir / name)
        try:
            damage(_committed(cases_dir / name) if name != "never-committed" else
                   next(p for p in (cases_dir / name).iterdir() if p.is_dir()))
            damaged[name] = True
        except Exception as exc:  # noqa: BLE001 - a layout without the damaged part
            damaged[name] = f"{type(exc).__name__}: {exc}"
    ended = _run({"name": "cases", "out": str(out), "ckpt": str(cases_dir), "cases": list(cases),
                  "cases_dir": str(cases_dir)})
    got = {r: json.loads((out / f"cases-rank{r}.json").read_text()) for r in range(2)
           if (out / f"cases-rank{r}.json").exists()}
    return {"ended": ended, "expected": {n: words for n, (_, words) in cases.items()},
            "got": {n: [got[r][n] if damaged[n] is True else ["(not damaged)", damaged[n]] for r in sorted(got)]
                    for n in cases}}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    work = Path(spec["dir"])
    out = work / "out"
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"trials": []}
    t0 = time.perf_counter()
    ref = {"name": "ref", "out": str(out), "ckpt": str(work / "ref"), "initial": str(work / "initial"),
           "step1": str(work / "ref-step1"), "dump_refs": True}
    report["ref"] = _run(ref)
    writes = {r: json.loads((out / f"ref-writes-rank{r}.json").read_text()) for r in range(2)}
    report["writes"] = writes
    renames = [i for i, w in enumerate(writes[0]) if w in ("os.rename CKPT/.latest.json.TMP.tmp", "os.rename CKPT")]
    commit = renames[-1]  # the rename that commits: the pointer's (before issue 30: the folder's, into its name)
    report["commit_index"] = commit
    refs = {(s, r): _tensors(out / f"ref-step{s}-rank{r}.safetensors") for s in (1, 2) for r in range(2)}

    def target(rank: int, i: int) -> tuple[int, str, int, int]:  # (rank, write, occurrence, index in the reference)
        return rank, writes[rank][i], writes[rank][:i].count(writes[rank][i]), i

    if spec["kills"] == "all":
        kills = [target(r, i) for r in range(2) for i in range(len(writes[r]))]
    else:  # one write of each phase: a model shard, consolidation, the optimizer, the record, the commit, collection
        def first(rank, pred):
            return target(rank, next(i for i, w in enumerate(writes[rank]) if pred(w)))

        kills = [
            first(1, lambda w: w.startswith("open ") and "/model/sharded/" in w),              # rank 1's model shard
            first(0, lambda w: w.startswith("open ") and w.endswith("/model/model-00001-of-00001.safetensors")),  # consolidation
            first(1, lambda w: w.startswith("open ") and "/optimizer/" in w),                  # rank 1's optimizer
            first(0, lambda w: w.startswith("shutil.rmtree ") and w.endswith("/model/sharded")),  # shards dropped
            first(0, lambda w: "fxpipe_state.json" in w),                                        # the record
            target(0, commit),                                                                   # the commit's rename
            target(0, commit + 1),                                                               # collection begins
            target(0, len(writes[0]) - 1),                                                       # the last write
        ]
    ckpt = work / "ckpt"
    # what the trials start from: a checkpoint of the first layout (step 1), and leftovers of its saves
    shutil.copytree(_committed(work / "ref-step1"), ckpt)
    (work / ".ckpt.partial-1-2" / "model").mkdir(parents=True)
    (work / ".ckpt.old-1").mkdir()
    previous: dict | None = {"first_layout": True, "expect_step": 1}
    report["trials"].append(previous)
    for i, (rank, write, occurrence, index) in enumerate(kills + [(None, None, None, None)]):
        job = {"name": f"t{i}", "out": str(out), "ckpt": str(ckpt), "initial": str(work / "initial"),
               "load_first": True, "kill_rank": rank, "kill_write": write, "occurrence": occurrence}
        ended = _run(job)
        # the state the previous kill left, as this job loaded it
        loaded_ok = all((out / f"t{i}-loaded-rank{r}.safetensors").exists() for r in range(2))
        step = previous["expect_step"]
        previous.update(loaded=loaded_ok, equal=loaded_ok and all(
            _equal(_tensors(out / f"t{i}-loaded-rank{r}.safetensors"), refs[(step, r)]) for r in range(2)))
        if rank is None:
            break
        versions = sorted(p.name for p in ckpt.iterdir() if p.is_dir()) if ckpt.is_dir() else []
        committed = _committed(ckpt) if ckpt.is_dir() else None  # None: no checkpoint under its name
        killed = any(e == f"signal {signal.SIGKILL}" for e in ended.values())
        expect = 2 if not killed or (rank == 0 and index > commit) else 1
        previous = {"rank": rank, "write": write, "occurrence": occurrence, "ended": ended, "killed": killed,
                    "committed_step": None if committed is None else
                    json.loads((committed / "fxpipe_state.json").read_text())["step"],
                    "expect_step": expect, "versions": versions}
        report["trials"].append(previous)
    if spec.get("cases"):
        report["cases"] = _bad_checkpoints(work, out)
    report["first_layout_left"] = sorted(p.name for p in ckpt.iterdir() if not p.is_dir() or not p.name.startswith("step")) \
        if ckpt.is_dir() else None
    report["leftovers_next_to_it"] = sorted(p.name for p in work.iterdir() if p.name.startswith(".ckpt"))
    report["seconds"] = time.perf_counter() - t0
    Path(sys.argv[2]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
