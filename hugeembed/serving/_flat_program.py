"""The served program as one plain function of flat tensors: the exported module's graph without its
per-call input plumbing.

``ExportedProgram.module()`` wraps its graph in pytree flattening of the inputs, a pre-hook that
matches their structure and shapes against the export's, and a no-op guards call: at one row that
plumbing cost 0.3 ms of CPU of a 0.5 ms model call (64 rows: ~0.4 of 2 ms), and the lookup's custom op
dispatch 60 us more (the graph calls its function, pooled_lookup_eager, instead); its weights, read through
module attributes at each call, are passed in as tensors (_lift_weights).  A ServingModel checks
its inputs itself (ParsedRequest.check, ServingModel.check) and always passes its own tables, so it
runs the same graph, same nodes and weights, as a function of
``(dense, values, offsets, *rows, *keys, *index, *meta)`` (the order pytree flattens the tables in).

Each node still runs the kernel it names, on the same inputs, so the logits are the module's bit for bit;
what changes is the way in (_direct_calls): aten ops through torch's generated bindings instead of the
boxed OpOverload path (2-3 us less a call, ~20 calls), a relu on a fresh single-use result in place,
and no nodes for the lookup's own float32 CPU output (its dtype assert and its no-op ``to``).
"""

from __future__ import annotations

from typing import Callable

import torch

from ._lookup_ops import pooled_lookup_eager
from ._patch import patched_lookup

__all__ = ["flat_program"]


_LOOKUP_OP = torch.ops.hugeembed_serve.pooled_lookup.default
_aten = torch.ops.aten
# aten ops -> the same op through torch's generated (unboxed) bindings: the same kernel, same arguments in the
# same positions (nodes with keyword arguments keep their OpOverload)
_DIRECT = {_aten.linear.default: torch._C._nn.linear, _aten.addmm.default: torch.addmm, _aten.mm.default: torch.mm,
           _aten.bmm.default: torch.bmm, _aten.relu.default: torch.relu, _aten.sigmoid.default: torch.sigmoid,
           _aten.cat.default: torch.cat, _aten.transpose.int: torch.transpose, _aten.unsqueeze.default: torch.unsqueeze,
           _aten.squeeze.dim: torch.squeeze, _aten.flatten.using_ints: torch.flatten,
           _aten.index_select.default: torch.index_select, _aten.view.default: torch.Tensor.view,
           _aten.reshape.default: torch.reshape, _aten.permute.default: torch.permute, _aten.mul.Tensor: torch.mul,
           _aten.add.Tensor: torch.add, _aten.sum.dim_IntList: torch.sum, _aten.t.default: torch.t}
# ops whose result is always a fresh tensor (never a view of an input): a relu may overwrite it when it is
# its only reader
_FRESH = {_aten.linear.default, _aten.addmm.default, _aten.mm.default, _aten.bmm.default, _aten.cat.default,
          _aten.add.Tensor, _aten.mul.Tensor}


def flat_program(program: torch.fx.GraphModule) -> Callable[..., torch.Tensor]:
    """A function of the program's flat inputs returning its logits, sharing its weights and buffers.

    Args:
        program: an unlifted exported module (``ExportedProgram.module()``, or version_program's copy).
    """
    graph = torch.fx.Graph()
    env = graph.graph_copy(program.graph, {})
    graph.output(env)
    for node in [n for n in graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        graph.erase_node(node)  # a no-op module: torch.export's placeholder for its shape guards
    for node in graph.nodes:  # the lookup op's own function, without the custom op's dispatch
        if node.op == "call_function" and node.target is _LOOKUP_OP:
            node.target = pooled_lookup_eager
    _direct_calls(graph)
    weights = _lift_weights(program, graph)
    graph.set_codegen(torch.fx.graph.CodeGen())  # positional tensors in, the output tuple out, no pytree
    flat = torch.fx.GraphModule(program, graph, class_name="FlatServedProgram")
    forward = flat.forward  # the generated function itself: no module hooks, no __call__ dispatch

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        (out,) = forward(*tensors, *weights)
        return out

    return run


def _lift_weights(program: torch.nn.Module, graph: torch.fx.Graph) -> tuple[torch.Tensor, ...]:
    """The graph's weights and buffers (get_attr nodes: ``getattr(self.model.top.net, "0").weight``, a chain of
    module attribute lookups, ~50 us a call for a DLRM's 15) made trailing inputs; returns the tensors to pass.
    The same tensors, shared: a version's program is never changed after it is built (a delta builds another)."""
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    weights = []
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        value = program
        for part in node.target.split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            continue
        with graph.inserting_after(last_input):
            lifted = graph.placeholder(f"w_{len(weights)}")
        last_input = lifted
        node.replace_all_uses_with(lifted)
        graph.erase_node(node)
        weights.append(value)
    return tuple(weights)


def _direct_calls(graph: torch.fx.Graph) -> None:
    """Rewrites `graph` in place: each node the same kernel on the same inputs, called the cheaper way."""
    lookups = (pooled_lookup_eager, patched_lookup)
    fresh = {n for n in graph.nodes if n.op == "call_function" and n.target in _FRESH}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        src = node.args[0] if node.args else None
        from_lookup = isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in lookups
        if node.target is _aten._assert_tensor_metadata.default and from_lookup:
            graph.erase_node(node)  # the lookup's result is float32, CPU, strided by construction
        elif node.target is _aten.to.device and from_lookup and node.args[1:3] == (torch.device("cpu"), torch.float32) \
                and not node.kwargs.get("copy", False):
            node.replace_all_uses_with(src)  # to() of a tensor already of that device and dtype returns it
            graph.erase_node(node)
        elif node.target is _aten.sym_size.int and len(node.args) == 2 and not node.kwargs:
            with graph.inserting_before(node):
                size = graph.call_method("size", node.args)
            node.replace_all_uses_with(size)
            graph.erase_node(node)
        elif node.target is _aten.relu.default and src in fresh and len(src.users) == 1 and not node.kwargs:
            node.target = torch.relu_  # the fresh result is read by this relu alone: overwrite it
        elif node.target in _DIRECT and not node.kwargs:
            node.target = _DIRECT[node.target]
    graph.lint()
