"""Optimal pipeline schedules with a SCIP MILP (OptPipe Section 3 and Appendix C), per device.

The model decides, for every stage ``s`` and micro-batch ``j``, the end times of the Forward
(F), Backward-input (B) and Backward-weight (W) ops and, on devices that hold one stage,
whether the forward stash of ``(s, j)`` is offloaded to the host and the start times of that
offload (O) and reload (R). It follows Contract 3 of DESIGN.md with placements
(``device_of_stage``):

* the F/B/W ops of all stages of one device share one compute stream: one order binary per
  pair of ops of a device whose order is not implied;
* ``t_comm`` only between stages on different devices;
* memory of a device at time ``t`` is the sum over its stages of the deltas of the F/B/W ops
  that have started by ``t``, minus ``offload_bytes`` for every offloaded stash with
  ``O.end <= t < R.start``; it is checked at every F start and every R start (memory only
  rises at those events, so these checks cover every op start). Offload is modelled on
  devices that hold one stage; on devices with several stages the model has no offload
  (``MilpVars.restricted`` says so and the returned bound is then the combinatorial one);
* objective ``stage_span`` (the largest per-device span; OptPipe Eq. 3 with one stage per
  device) or ``makespan`` (OptPipe Eq. 4);
* optional pcie groups: O/R ops of stages in one group never overlap (OptPipe Eq. 18-19).

Solver-level techniques of OptPipe Section 4.1:

* fixed micro-batch order per op type and stage (F(s,j) before F(s,j+1), same for B, W, and
  for the O and R of offloaded stashes), OptPipe Eq. 1 / Section 4.1.1; an exchange argument
  shows this loses no optimal schedule because micro-batches are identical;
* one binary per *unordered* pair of ops of a device whose order is not already implied by
  the transitive closure of the dependencies, the fixed order and the memory-implied orders
  (Section 4.1.1, Figure 3); on one stage only ``B_j|F_k``, ``W_j|F_k``, ``W_j|B_k`` with
  ``j < k`` remain, across the stages of a device those the chain does not order;
* monotonicity cuts (triangle inequalities with one fixed leg) always, full triangle
  inequality cuts (Section 4.1.2) when ``triangle_cuts=True`` and the model is small;
* memory-implied orders (:func:`memory_implied_orders`): orders every schedule within the
  limit must follow (e.g. B_0 before F_5 when five stashes fill the limit) become fixed
  orders, without variables;
* energetic head/tail inequalities: the ops fixed before (after) an op fit between the
  device's first F and that op (that op and the device's last W); with the memory-implied
  orders they prove the Zero Bubble toy instances optimal at the root;
* objective cut ``C >= combinatorial bound`` (:func:`fxpipe.schedule.bounds.combinatorial_lower_bound`:
  memory-aware warm-up and drain bubbles, per device); SCIP stops as soon as an incumbent
  reaches it, and a warm start that reaches it is returned as optimal without a model;
* big-M from the warm start's value: every op of a device lies in a window of length at
  most the objective value ``C <= H`` (``H`` = warm start value), so ``H`` bounds every
  same-device time difference;
* bound probing before SCIP (:mod:`~fxpipe.schedule.milp.time_indexed`): when all durations
  lie on a common grid, bisection on the value with per-device time-indexed feasibility
  models (windows from the pipeline's difference constraints) proves a bound the big-M
  relaxation never reaches; it becomes the objective cut and the reported bound;
* the best valid heuristic schedule is given to SCIP as the initial solution (Section 4.1.3);
* an event handler on ``BESTSOLFOUND`` reports each new incumbent (Section 4.3).

Modules: :mod:`~fxpipe.schedule.milp.builder` (pure model builder),
:mod:`~fxpipe.schedule.milp.feasibility` (memory feasibility, the trivial schedule),
:mod:`~fxpipe.schedule.milp.warm_start` (heuristic start and its variable values),
:mod:`~fxpipe.schedule.milp.extract` (solution to validated ops),
:mod:`~fxpipe.schedule.milp.solve` (SCIP through :func:`fxpipe.mip.solve_model`),
:mod:`~fxpipe.schedule.milp.time_indexed` (probe bounds). No torch.

References
----------
OptPipe: Memory- and Scheduling-Optimized Pipeline Parallelism for LLM Training
(``shared/papers/optpipe-milp-pipeline-scheduling.txt``), Sections 3, 4.1-4.3, Appendix C.
PipeOffload (``shared/papers/pipeoffload-selective-activation-offload.txt``), Section 2.
"""

from fxpipe.schedule.milp.builder import MilpVars, build_model, memory_implied_orders, order_literal
from fxpipe.schedule.milp.extract import extract_schedule
from fxpipe.schedule.milp.solve import Incumbent, solve
from fxpipe.schedule.milp.time_indexed import ProbeBound, exact_grid, probe_lower_bound
from fxpipe.schedule.milp.feasibility import check_memory_feasible, sequential_schedule
from fxpipe.schedule.milp.warm_start import warm_start_schedule, warm_start_values

#: Older name of :func:`sequential_schedule`.
_sequential_schedule = sequential_schedule

__all__ = [
    "Incumbent",
    "MilpVars",
    "ProbeBound",
    "build_model",
    "check_memory_feasible",
    "exact_grid",
    "extract_schedule",
    "memory_implied_orders",
    "order_literal",
    "probe_lower_bound",
    "sequential_schedule",
    "solve",
    "warm_start_schedule",
    "warm_start_values",
]
