"""Nothing silently wrong at run time (issue 30, items 2, 4 and 12), on 2 gloo ranks.

* Item 2: FSDP2 needs one parameter dtype per unit ("FSDP expects uniform original parameter dtype"), so
  every stage is wrapped as one unit per dtype (``fxpipe.codegen.mesh.dtype_units``; the bf16 + fp32
  models training on ``mesh="auto"``'s FSDP2 plan are the mixed-dtype row of the real-architecture matrix,
  ``tests/test_arch_matrix3.py``). A submodule that holds two dtypes itself cannot be split so: the mesh
  search skips data parallelism for that model, with the reason in its candidate table
  (``fxpipe.mesh.limits``).
* Item 12: MobileBERT ties its word embedding (stage 0) to the MLM decoder, which uses it as
  ``cat([decoder.weight.t(), dense.weight])`` on the last stage. Under split backward (ZB-H1, ZB-H2)
  torch's backward-weight pass kept that gradient as a transposed view, which reached the tied-gradient
  all-reduce as a non-contiguous tensor: both ranks ended the step with different, wrong gradients.
  The runtime now gives each parameter a gradient of its own and checks the copies of every tie for
  agreement after the all-reduce (a user loop whose optimizer leaves out one copy is stopped).
* Item 4: a loss that is not finite stops the step with "the loss is not finite at step s, stage k,
  micro-batch j" in a user's loop over ``plan.build`` and in ``train_local`` / ``--run`` (it was
  ``"losses": [NaN]`` with exit 0, or a "pipelined vs single-process" difference).

The ``train_local`` runs share one set of workers (``spawn_train_many``); the user loops one
``run_local`` job.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.codegen.compare import compare_training  # noqa: E402
from fxpipe.codegen.launch import RunError, reference_train, spawn_train_many  # noqa: E402
from fxpipe.codegen.mesh import data_parallel_limit, dtype_units  # noqa: E402
from fxpipe.codegen.split import split_stages  # noqa: E402
from fxpipe.dynamo.local import run_local  # noqa: E402
from fxpipe.errors import InputError  # noqa: E402
from fxpipe.mesh.limits import mesh_runtime_limit, runtime_limits  # noqa: E402
from fxpipe.plan.build import PlanStageOf  # noqa: E402
from fxpipe.testing import zoo  # noqa: E402

import _runtime_models as M  # noqa: E402

pytestmark = pytest.mark.timeout(900)

STEPS, LR = 2, 0.05


# ----------------------------------------------------------------------------- item 2, one process
def test_dtype_units_give_every_fsdp_unit_one_dtype():
    model = zoo.get("mixed_dtype").one_microbatch()[0]  # fp32 in / norm / out around a bf16 middle
    units = dtype_units(model)
    # the bf16 block has the most elements: the root unit keeps it; the fp32 layers form one unit
    assert [[type(m).__name__ for m in u] for u in units] == [["Linear", "LayerNorm", "Linear"]]
    in_units = {id(p) for m in units[0] for p in m.parameters()}
    assert {p.dtype for m in units[0] for p in m.parameters()} == {torch.float32}
    assert {p.dtype for p in model.parameters() if id(p) not in in_units} == {torch.bfloat16}
    assert dtype_units(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == []
    frozen = zoo.get("mixed_dtype").one_microbatch()[0]
    frozen.mid.requires_grad_(False)  # FSDP2 checks trainable parameters only
    assert dtype_units(frozen) == []
    with pytest.raises(InputError, match=r"submodule 'b' holds trainable parameters of several dtypes itself"):
        dtype_units(M.TwoDtypeModule(), "stage 0")
    assert "several dtypes itself" in data_parallel_limit(M.TwoDtypeModule())
    assert data_parallel_limit(model) is None


def test_mesh_search_skips_data_parallelism_the_runtime_cannot_run():
    """The limit found on the capture is recorded with the graph; the search offers the pure pipeline
    and says why in the skipped rows. The same model with one dtype gets data parallelism (so the
    limit, not the costs, decides)."""
    x = torch.randn(M.BATCH // M.MICROBATCHES, M.D)
    torch.manual_seed(0)
    plan = fxpipe.compile(M.TwoDtypeModule(), (x,), devices=2, microbatches=M.MICROBATCHES, time_limit_s=0.3)
    assert plan.mesh == {"pp": 2, "dp_shard": 1, "dp_replicate": 1}
    assert "several dtypes itself" in runtime_limits(plan.graph)["data_parallel"]
    rows = {r["mesh_text"]: r for r in plan.options["mesh_search"]}
    assert rows["pp=2"].get("chosen")
    assert all("the runtime cannot run data parallelism for this model" in r["skipped"]
               for t, r in rows.items() if r["mesh"]["dp_shard"] * r["mesh"]["dp_replicate"] > 1)
    assert all(r["mesh"].get("tp", 1) > 1 for t, r in rows.items() if t != "pp=2"  # tp alone wraps no FSDP2 unit
               and r["mesh"]["dp_shard"] * r["mesh"]["dp_replicate"] == 1)
    torch.manual_seed(0)
    uniform = M.TwoDtypeModule()
    uniform.b.scale.data = uniform.b.scale.data.float()
    other = fxpipe.compile(uniform, (x,), devices=2, microbatches=M.MICROBATCHES, time_limit_s=0.3)
    assert other.mesh["dp_shard"] * other.mesh["dp_replicate"] > 1
    with pytest.raises(InputError, match=r"mesh dp_shard=2: the runtime cannot run data parallelism for this model"):
        fxpipe.compile(M.TwoDtypeModule(), (x,), devices=2, microbatches=M.MICROBATCHES, time_limit_s=0.3,
                       mesh={"pp": 1, "dp_shard": 2})  # pinned: refused at plan time, not on every rank
    limits = {"data_parallel": "why"}
    assert mesh_runtime_limit({"pp": 1, "dp_shard": 2, "dp_replicate": 1}, False, limits)
    assert mesh_runtime_limit({"pp": 2, "dp_shard": 1, "dp_replicate": 1}, True, limits)  # host optimizer: FSDP2
    assert mesh_runtime_limit({"pp": 2, "dp_shard": 1, "dp_replicate": 1}, False, limits) is None
    assert mesh_runtime_limit({"pp": 1, "dp_shard": 2, "dp_replicate": 1}, False, {}) is None


# ----------------------------------------------------------------------------- the 2-rank runs
def _train_run(plan, zm, **over) -> dict:
    """The run ``plan.train_local`` launches (fxpipe/plan/train.py) for a pipeline plan, as a ``spawn_train_many`` entry."""
    run = dict(make_model=zm, make_batch=zm.batch, loss=zm.loss, stage_of=plan.worker_stage_of(), orders=plan.orders(),
               num_microbatches=plan.global_microbatches, steps=STEPS, lr=LR, recompute_stages=plan.recompute_stages(),
               model_key=zm.name)
    run.update(over)
    return run


def _mid_cut(plan) -> PlanStageOf:
    """Half of the graph's nodes (program order) on stage 0: MobileBERT's decoder, which reads the word
    embedding through ``t``/``cat`` (nodes on parameters only, which the partitioner may put anywhere), is
    then on stage 1 and the embedding on stage 0, whatever the partition search chose."""
    from fxpipe.passes.structure import PlanStructure

    names = list(plan.graph.names)
    cut = {n: int(i >= len(names) // 2) for i, n in enumerate(names)}
    return PlanStageOf(cut, PlanStructure.from_graph(plan.graph))


@pytest.fixture(scope="module")
def runs():
    bert = zoo.get("mobilebert")
    model, args, kwargs = bert.one_microbatch()
    plan = fxpipe.compile(model, args, kwargs, devices=2, microbatches=bert.microbatches, time_limit_s=0.3,
                          schedule="zb-h1", mesh="pipeline")
    cut = _mid_cut(plan)
    bert_runs = {"zb-h1": _train_run(plan, bert, stage_of=cut),
                 "zb-h2": _train_run(plan.reschedule("zb-h2"), bert, stage_of=cut)}
    staged = split_stages(plan.captured().gm, cut(plan.captured().gm), 2)
    tied = staged.shared_params.get("mobilebert.embeddings.word_embeddings.weight")
    model, (x,) = M.make_mlp()
    nan_plan = fxpipe.compile(model, (x[: M.BATCH // M.MICROBATCHES],), devices=2, microbatches=M.MICROBATCHES,
                              time_limit_s=0.3, mesh="pipeline")
    nan_run = dict(make_model=M.make_mlp, make_batch=M.batch_nan, loss="mse", stage_of=nan_plan.worker_stage_of(),
                   orders=nan_plan.orders(), num_microbatches=M.MICROBATCHES, steps=STEPS, lr=LR)
    # the run expected to fail goes last (a failed run restarts the workers)
    results = spawn_train_many([bert_runs["zb-h1"], bert_runs["zb-h2"], nan_run],
                               world_size=2, on_error="record", timeout_s=600, warn_random=False)
    ref = reference_train(bert, bert.batch, num_microbatches=bert.microbatches, steps=STEPS, lr=LR, loss=bert.loss)
    return {"zb-h1": (tied, results[0], ref), "zb-h2": (tied, results[1], ref), "nan": results[2]}


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_tied_weight_under_split_backward_equals_one_process(runs, schedule):
    tied, res, ref = runs[schedule]
    assert tied == (0, 1)  # the tie crosses the ranks: the case that went wrong
    assert not isinstance(res, RunError), res.message
    cmp = compare_training(res, ref)
    assert cmp.ok, cmp.explain()
    w = "mobilebert.embeddings.word_embeddings.weight"
    scale = float(ref.grads[w].abs().max())
    assert float((res.grads[w] - ref.grads[w]).abs().max()) <= 1e-5 * scale


def test_non_finite_loss_stops_train_local_naming_step_stage_and_microbatch(runs):
    res = runs["nan"]
    assert isinstance(res, RunError), "a NaN loss trained on"
    msg = f"the loss is not finite at step {M.NAN_STEP}, stage 1, micro-batch {M.NAN_MICROBATCH}"
    assert msg in res.message and "TrainingError" in res.message


# ----------------------------------------------------------------------------- user loops over plan.build
@pytest.fixture(scope="module")
def user_loops(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("user_loops")
    paths = {}
    for name in ("make_mlp", "make_tied_ends"):
        model, (x,) = getattr(M, name)()
        plan = fxpipe.compile(model, (x[: M.BATCH // M.MICROBATCHES],), devices=2, microbatches=M.MICROBATCHES,
                              time_limit_s=0.3, mesh="pipeline")
        if name == "make_tied_ends":
            staged = split_stages(plan.captured().gm, plan.stage_of, 2)
            assert staged.shared_params.get("first.weight") == (0, 1)
        paths[name] = str(plan.save(tmp / f"{name}.json"))

    jobs = [(paths["make_mlp"], "make_mlp", "batch_nan", STEPS, None),
            (paths["make_tied_ends"], "make_tied_ends", "batch_bn_unused", 3, 1)]
    return run_local(M.user_loops, 2, args=(jobs,), timeout_s=600)


def test_non_finite_loss_stops_a_user_loop_over_plan_build(user_loops):
    first, last = user_loops[0][0], user_loops[1][0]
    assert first == {"step": STEPS, "error": None}  # stage 0 has no loss; its rank finishes its step
    assert last["step"] == M.NAN_STEP
    assert last["error"].startswith(f"the loss is not finite at step {M.NAN_STEP}, stage 1, "
                                    f"micro-batch {M.NAN_MICROBATCH}: nan")


def test_tied_copies_that_drift_apart_stop_the_step(user_loops):
    """Rank 1's optimizer leaves out its copy of the tie: after one update the copies differ, and the
    next step's check says so on both ranks instead of training on."""
    for rank in (0, 1):
        got = user_loops[rank][1]
        assert got["step"] == 1, got
        assert "tied parameter" in got["error"] and "first.weight" in got["error"] and "parameter sum" in got["error"]
