"""Per-block FSDP2 units at run time: each repeated block of a stage carved into a submodule that owns its parameters.

A stage program is an fx ``GraphModule`` that reads its parameters with ``get_attr`` nodes, so the
forward hooks of a submodule (``model.layers.3``) never fire: ``fully_shard`` on it would never
unshard it. :func:`carve_blocks` turns every block of a stage (the plan's
:func:`fxpipe.memory.checkpoint.find_blocks` names, module paths such as ``"model.layers.3"``) into
one ``call_module`` of a ``GraphModule`` installed at that same path, which owns the block's
parameters under their own names (``model.layers.3.self_attn.q_proj.weight`` stays the parameter's
fully qualified name, so checkpoints, tied-parameter groups and comparisons keep working) and reads
them with its own ``get_attr`` nodes. :func:`fxpipe.codegen.mesh.data_parallel_wrapper` then calls
``fully_shard`` on every carved block and on the stage (the root unit), as torchtitan does, and the
schedule runtime (:mod:`fxpipe.codegen.runtime`) lets FSDP2 unshard and reshard the blocks around
their own forward and backward and reduce-scatter their gradients after every micro-batch (ZeRO-3),
keeping only the root unsharded for the step (:mod:`fxpipe.memory.fsdp` is the memory model of this).

A block is the span of the stage program from its first to its last node whose module path lies in
the block (ops of no module between them, such as the capture's per-layer copies of a mask, come
with it, as :func:`~fxpipe.memory.checkpoint.find_blocks` absorbs them); each span is contiguous in
program order, hence convex. A block is not carved (it stays in the root unit, and the stage
reports it) when a parameter of it is read outside its span (a tied parameter), or when the stage
holds nothing of it. Activation-checkpoint segments already carved in the stage
(:func:`fxpipe.codegen.checkpointing.apply_checkpoint`: per-block ``"full"`` / ``"selective"``
segments lie inside blocks) move into their block's submodule, where they replay on the block's
unsharded parameters during its backward.
"""

from __future__ import annotations

import logging
import operator
from typing import Sequence

import torch
import torch.fx as fx

__all__ = ["BLOCKS_ATTR", "block_modules", "carve_blocks", "node_module_path"]

logger = logging.getLogger(__name__)

#: The attribute of a stage module listing the paths of its carved blocks (read by the runtime).
BLOCKS_ATTR = "fxpipe_fsdp_blocks"


def node_module_path(node: fx.Node) -> str:
    """The module path of the innermost module a captured node ran in (``""`` for none)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1]
    return str(path[0] if isinstance(path, tuple) else path)


def _within(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def carve_blocks(module: fx.GraphModule, blocks: Sequence[str], stage: int = 0) -> list[str]:
    """Carve every block of ``blocks`` a stage computes into a submodule owning its parameters, in place.

    Parameters
    ----------
    module : torch.fx.GraphModule
        A stage module of :func:`fxpipe.codegen.split.split_stages`.
    blocks : sequence of str
        Module paths of the model's repeated blocks (``find_blocks(plan.graph).names``).
    stage : int
        For messages.

    Returns
    -------
    list[str]
        The paths carved, in program order; ``module.fxpipe_fsdp_blocks`` holds them too.
    """
    g = module.graph
    carved: list[str] = []
    for block in blocks:
        nodes = list(g.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        members = [n for n in nodes if (n.op == "call_function" and _within(node_module_path(n), block))
                   or (n.op == "call_module" and _segment_within(module, n, block))]
        if not members:
            continue
        lo, hi = pos[members[0]], pos[members[-1]]
        params = [n for n in nodes if n.op == "get_attr" and _within(str(n.target), block)]
        run = [n for n in nodes[lo:hi + 1] if n.op == "call_function" or n in members]
        inset = set(run) | set(params)
        if any(u not in inset for p in params for u in p.users):
            logger.info("stage %d: block %s stays in the root unit (a parameter of it is read outside it)", stage, block)
            continue
        _carve(module, g, block, sorted(inset, key=pos.__getitem__))
        carved.append(block)
    g.lint()
    module.recompile()
    setattr(module, BLOCKS_ATTR, tuple(carved))
    return carved


def _carve(module: fx.GraphModule, g: fx.Graph, block: str, run: list[fx.Node]) -> None:
    """Replace ``run`` (the block's ops and ``get_attr`` nodes, in program order) by one ``call_module`` of ``block``."""
    inset = set(run)
    ins: list[fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in inset and a not in ins:
                ins.append(a)
    outs = [n for n in run if any(u not in inset for u in n.users)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in ins:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    cut = len(block) + 1
    for n in run:
        if n.op == "get_attr":
            env[n] = body.get_attr(str(n.target)[cut:])
            env[n].meta = dict(n.meta)
        else:
            env[n] = body.node_copy(n, lambda a: env[a])
    body.output(tuple(env[o] for o in outs))
    holder = torch.nn.Module()  # what the body reads, by reference, at its names inside the block
    for n in body.nodes:
        if n.op == "get_attr":
            _move_attr(module, f"{block}.{n.target}", holder, str(n.target))
        elif n.op == "call_module":  # a checkpoint segment of the block (fxpipe.codegen.checkpointing)
            holder.add_module(str(n.target), module.get_submodule(str(n.target)))
    sub = fx.GraphModule(holder, body, class_name="FsdpBlock")
    for n in run:
        if n.op == "call_module":
            delattr(module, str(n.target))
    parent, _, leaf = block.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, sub)
    last = [n for n in run if n.op != "get_attr"][-1]
    with g.inserting_after(last):
        call = g.call_module(block, tuple(ins))
    with g.inserting_after(call):
        getters = [g.call_function(operator.getitem, (call, i)) for i in range(len(outs))]
    for o, get in zip(outs, getters):
        get.meta = dict(o.meta)
        o.replace_all_uses_with(get, delete_user_cb=lambda u: u not in inset)
    for n in reversed(run):
        g.erase_node(n)


def _segment_within(module: fx.GraphModule, node: fx.Node, block: str) -> bool:
    """A carved checkpoint segment (a ``call_module`` of the stage) all of whose ops lie in ``block``."""
    body = getattr(module.get_submodule(str(node.target)), "body", None)
    if not isinstance(body, fx.GraphModule):
        return False
    paths = [node_module_path(n) for n in body.graph.nodes if n.op == "call_function"]
    paths = [p for p in paths if p]
    return bool(paths) and all(_within(p, block) for p in paths)


def _move_attr(src: torch.nn.Module, target: str, dst: torch.nn.Module, name: str) -> None:
    """Register ``src``'s parameter / buffer / attribute ``target`` in ``dst`` at ``name`` (same object)."""
    owner_path, _, leaf = target.rpartition(".")
    owner = src.get_submodule(owner_path) if owner_path else src
    obj = getattr(owner, leaf)
    path, _, new_leaf = name.rpartition(".")
    at = dst
    for part in path.split(".") if path else ():
        if not hasattr(at, part):
            at.add_module(part, torch.nn.Module())
        at = getattr(at, part)
    if leaf in owner._buffers:
        at.register_buffer(new_leaf, obj, persistent=leaf not in owner._non_persistent_buffers_set)
    elif isinstance(obj, torch.nn.Parameter):
        at.register_parameter(new_leaf, obj)
    else:
        setattr(at, new_leaf, obj)


def block_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The carved block submodules of a stage module (:func:`carve_blocks`), in program order."""
    return [module.get_submodule(p) for p in getattr(module, BLOCKS_ATTR, ())]
