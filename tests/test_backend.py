"""The torch.compile backend in one process: ``torch.compile(model, backend="fxpipe", options=...)`` (issue 10).

Registered by name (entry point), options checked up front, the plan of Dynamo's graph with the
user's parameters as parameters, outputs equal to eager for GPT-2, T5 and a U-Net (the planned
stages themselves run: ``execution="stages"``), graph breaks named, Inductor execution, reports.
Multi-process runs (pipelined inference on 2 and 4 ranks, compile_stages training) are in
``test_backend_distributed.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.testing import zoo  # noqa: E402
from fxpipe.codegen.interface import as_call  # noqa: E402
from fxpipe.codegen.runtime import tree_flatten  # noqa: E402
from fxpipe.errors import InputError  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _leaves(out):
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


class _MLP(torch.nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.l1 = torch.nn.Linear(d, 32)
        self.l2 = torch.nn.Linear(32, 32)
        self.l3 = torch.nn.Linear(32, d)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


class _Breaks(_MLP):
    def forward(self, x):
        h = torch.relu(self.l1(x))
        if h.sum().item() > -1e9:  # data-dependent Python control flow: a graph break
            h = h * 2
        return self.l3(torch.relu(self.l2(h)))


@pytest.fixture(autouse=True)
def _fresh():
    from fxpipe.dynamo import clear_plans

    torch._dynamo.reset()

    clear_plans()
    yield
    torch._dynamo.reset()


def test_registered_by_name_and_callable():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "fxpipe"]
    assert eps and eps[0].value == "fxpipe.dynamo.compiler:fxpipe_backend"
    assert "fxpipe" in torch._dynamo.list_backends()
    be = fxpipe.backend(devices=2, microbatches=2)
    assert be.options.devices == 2 and be.options.compile_kwargs["microbatches"] == 2
    with pytest.raises(InputError, match="has not planned any graph yet"):
        fxpipe.last_plan()


def test_bad_options_are_named():
    with pytest.raises(InputError, match=r"unknown option\(s\) 'device'.*valid options: .*devices"):
        fxpipe.backend(device=2)
    with pytest.raises(InputError, match="'execution' must be one of"):
        fxpipe.backend(execution="fast")
    with pytest.raises(InputError, match="'devices' must be an integer >= 1"):
        fxpipe.backend(devices=0)
    m = _MLP()
    c = torch.compile(m, backend="fxpipe", options={"graph_breaks": "maybe"})
    with pytest.raises(Exception, match="'graph_breaks' must be one of"):
        c(torch.randn(4, 16))


@pytest.mark.parametrize("name", ["gpt2", "t5", "unet"])
def test_one_process_outputs_equal_eager_with_two_stages(name):
    """The planned stages run one after the other on 2 micro-batches (the batch dim marked dynamic)."""
    model, inputs = zoo.get(name, microbatches=2, microbatch_size=2)()
    model.eval()
    args, kwargs = as_call(inputs)
    with torch.no_grad():
        ref = model(*args, **kwargs)
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_dynamic(t, 0)
    compiled = torch.compile(model, backend="fxpipe", options={"devices": 2, "time_limit_s": 0.5, "execution": "stages"})
    with torch.no_grad():
        got = compiled(*args, **kwargs)
    assert type(got) is type(ref)
    a, b = _leaves(ref), _leaves(got)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    plan = fxpipe.last_plan()
    assert plan.num_stages == 2 and len(plan.stages) == 2 and plan.microbatches == 2
    assert plan.objective == "inference"  # no gradients: the inference objective
    # the user's weights are the plan's parameters (not constants): they are costed and trainable
    owned = {id(p) for p in model.parameters()}
    captured = list(plan.captured().gm.parameters())
    assert captured and all(id(p) in owned for p in captured)
    assert plan.options["backend"]["execution"] == "stages" and not plan.options["pipelined"]


def test_graph_break_is_named_and_separate_plans_each_subgraph():
    m = _Breaks().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        ref = m(x)
    c = torch.compile(m, backend="fxpipe", options={"devices": 2})
    with pytest.raises(Exception) as info:
        c(x)
    msg = str(info.value)
    assert "graph break" in msg and "Reason:" in msg and "User stack:" in msg
    assert "test_backend.py" in msg and ".item()" in msg  # the user's line that breaks
    assert "graph_breaks': 'separate'" in msg
    torch._dynamo.reset()
    c = torch.compile(m, backend="fxpipe", options={"devices": 2, "graph_breaks": "separate", "time_limit_s": 0.5})
    with torch.no_grad():
        got = c(x)
    torch.testing.assert_close(got, ref)
    from fxpipe.dynamo import plans

    assert len(plans()) >= 2  # one plan per subgraph


def test_inductor_execution_static_batch_and_report(tmp_path):
    m = _MLP().eval()
    x = torch.randn(6, 16)
    with torch.no_grad():
        ref = m(x)
    report = tmp_path / "plan.html"
    c = torch.compile(m, backend=fxpipe.backend(devices=2, execution="inductor", report=str(report),
                                                 bounds_time_limit_s=2.0, time_limit_s=0.5))
    with torch.no_grad():
        got = c(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    plan = fxpipe.last_plan()
    assert plan.num_stages == 2
    # a static batch dimension: one micro-batch, and the reason is kept
    assert plan.microbatches == 1 and "mark_dynamic" in plan.options["microbatch_note"]
    assert report.exists() and report.with_suffix(".md").exists()
    assert "lower bound" in report.with_suffix(".md").read_text().lower()
    torch._dynamo.reset()
    c = torch.compile(m, backend="fxpipe", options={"devices": 2, "microbatches": 2})
    with pytest.raises(Exception, match="micro-batches cut from the batch dimension"):
        c(x)


def test_pipelined_training_call_is_refused_with_what_to_do():
    """Outside no_grad a pipelined/stage forward would silently drop gradients: refused."""
    m = _MLP()
    x = torch.randn(4, 16)
    torch._dynamo.mark_dynamic(x, 0)
    c = torch.compile(m, backend="fxpipe", options={"devices": 2, "execution": "stages", "time_limit_s": 0.5})
    with pytest.raises(Exception, match=r"fxpipe.last_plan\(\).build\(rank"):
        c(x)
