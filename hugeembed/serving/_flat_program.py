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
"""

from __future__ import annotations

from typing import Callable

import torch

from ._lookup_ops import pooled_lookup_eager

__all__ = ["flat_program"]


_LOOKUP_OP = torch.ops.hugeembed_serve.pooled_lookup.default


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
