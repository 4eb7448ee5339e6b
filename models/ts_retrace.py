"""A TorchScript module as a Python module that `torch.export` can trace:
its frozen, inlined graph run node by node, tensor ops through the
dispatcher (`torch.ops.aten`), everything else (lists, dicts, tuples,
objects, `if` and loops over values known at trace time) as Python. Tracing
that interpreter records only the tensor ops, so the result exports and
compiles (AOTInductor) like a module written in Python.

Why not PyTorch's own converter (`torch._export.converter.TS2EPConverter`,
torch 2.13): on TorchRec-packaged graphs it fails before converting
anything, because the graph builds `KeyedTensor` objects
(`prim::CreateObject`, `prim::SetAttr`/`prim::GetAttr`) and the converter
resolves every `GetAttr` against the root module; with those replaced by
their fields it stops at `KeyedTensor.to_dict`'s loops over its keys (a
loop whose trip count is a list's length). Here both are plain Python at
trace time.

What it cannot take, and refuses naming the node: control flow on tensor
values (an `if` on a tensor, a loop over a tensor's length that is not
known while tracing), and TorchScript ops it has no rule for.
"""

import operator
import types
from typing import Any, Dict, List

import torch
from torch import nn

# JIT-only ops on lists, dicts, tuples and strings (whatever they hold):
# Python's own.
CONTAINER_OPS = {
    "aten::__getitem__": operator.getitem,
    "aten::_set_item": operator.setitem,
    "aten::len": len,
    "aten::items": lambda d: list(d.items()),
    "aten::keys": lambda d: list(d.keys()),
    "aten::values": lambda d: list(d.values()),
    "aten::__is__": operator.is_,
    "aten::__isnot__": operator.is_not,
    "aten::__not__": operator.not_,
    "aten::__contains__": operator.contains,
    "aten::append": lambda xs, x: xs.append(x),
    "prim::unchecked_cast": lambda x: x,
    "prim::Uninitialized": lambda: None,
}

# Ops on numbers: Python's own unless a tensor is involved.
SCALAR_OPS = {
    "aten::eq": operator.eq,
    "aten::ne": operator.ne,
    "aten::lt": operator.lt,
    "aten::le": operator.le,
    "aten::gt": operator.gt,
    "aten::ge": operator.ge,
    "aten::add": operator.add,
    "aten::sub": operator.sub,
    "aten::mul": operator.mul,
    "aten::floordiv": operator.floordiv,
    "aten::neg": operator.neg,
    "aten::Int": int,
    "aten::Float": float,
    "aten::Bool": bool,
    "prim::min": min,
    "prim::max": max,
}

ISINSTANCE = {"Dict": dict, "List": list, "Tuple": tuple, "Tensor": torch.Tensor, "str": str, "int": int,
              "float": float, "bool": bool}


class RetracedScript(nn.Module):
    """`script`'s forward (frozen and inlined) as a traceable module; its
    tensor constants (the weights, after freezing) are buffers, so
    `.to(dtype)` casts the floating-point ones."""

    def __init__(self, script: torch.jit.ScriptModule) -> None:
        super().__init__()
        frozen = torch.jit.freeze(script.eval())
        self.graph = frozen.graph
        torch._C._jit_pass_inline(self.graph)
        self.constant_names: Dict[str, str] = {}
        for i, node in enumerate(self.graph.findAllNodes("prim::Constant")):
            value = node.output()
            if value.type().kind() == "TensorType":
                name = f"constant_{i}"
                self.register_buffer(name, value.toIValue())
                self.constant_names[value.debugName()] = name
        # Not a submodule: the graph's `self`, for the attributes freezing
        # left (none in the graphs seen).
        object.__setattr__(self, "root", frozen)

    def __deepcopy__(self, memo):
        """A copy with its own buffers (so that `.to(dtype)` leaves this one
        alone), sharing the graph, which is never changed after `__init__`."""
        twin = RetracedScript.__new__(RetracedScript)
        nn.Module.__init__(twin)
        twin.graph, twin.constant_names = self.graph, dict(self.constant_names)
        object.__setattr__(twin, "root", self.root)
        for name, buffer in self.named_buffers():
            twin.register_buffer(name, buffer.clone())
        return twin

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """A dense network's signature: (dense, pooled) -> scores."""
        inputs = list(self.graph.inputs())
        env: Dict[str, Any] = {inputs[0].debugName(): self.root}
        for value, arg in zip(inputs[1:], (dense, pooled)):
            env[value.debugName()] = arg
        return self.run_block(self.graph, env)[0]

    def run_block(self, block, env: Dict[str, Any]) -> List[Any]:
        for node in block.nodes():
            results = self.run_node(node, env)
            for value, result in zip(node.outputs(), results):
                env[value.debugName()] = result
        return [env[value.debugName()] for value in block.outputs()]

    def run_node(self, node, env: Dict[str, Any]) -> List[Any]:
        kind = node.kind()
        args = [env[value.debugName()] for value in node.inputs()]
        if kind == "prim::Constant":
            value = node.output()
            if value.debugName() in self.constant_names:
                return [getattr(self, self.constant_names[value.debugName()])]
            return [None if value.type().kind() == "NoneType" else value.toIValue()]
        if kind == "prim::ListConstruct":
            return [list(args)]
        if kind == "prim::TupleConstruct":
            return [tuple(args)]
        if kind == "prim::DictConstruct":
            return [dict(zip(args[0::2], args[1::2]))]
        if kind in ("prim::ListUnpack", "prim::TupleUnpack"):
            return list(args[0])
        if kind == "prim::TupleIndex":
            return [args[0][args[1]]]
        if kind == "prim::CreateObject":
            return [types.SimpleNamespace()]
        if kind == "prim::SetAttr":
            setattr(args[0], node.s("name"), args[1])
            return []
        if kind == "prim::GetAttr":
            return [getattr(args[0], node.s("name"))]
        if kind == "prim::isinstance":
            wanted = tuple(ISINSTANCE[t.split("(")[0].split("[")[0]] for t in map(str, node.tys("types")))
            return [isinstance(args[0], wanted)]
        if kind == "prim::RaiseException":
            raise RuntimeError(f"the TorchScript graph raised: {args[0] if args else ''}")
        if kind == "prim::If":
            self.require_known(args[0], node)
            then, otherwise = node.blocks()
            return self.run_block(then if args[0] else otherwise, env)
        if kind == "prim::Loop":
            return self.run_loop(node, args, env)
        if kind in CONTAINER_OPS:
            return self.results(node, CONTAINER_OPS[kind](*args))
        if kind in SCALAR_OPS and not any(isinstance(a, torch.Tensor) for a in args):
            return self.results(node, SCALAR_OPS[kind](*args))
        if kind.startswith("aten::"):
            return self.results(node, self.aten(node, args))
        raise SystemExit(f"TorchScript node {kind} has no rule to retrace it: {node}")

    def run_loop(self, node, args, env) -> List[Any]:
        trips, condition, carried = args[0], args[1], list(args[2:])
        self.require_known(trips, node)
        body = next(node.blocks())
        params = list(body.inputs())
        i = 0
        while i < trips and condition:
            env[params[0].debugName()] = i
            for value, current in zip(params[1:], carried):
                env[value.debugName()] = current
            outputs = self.run_block(body, env)
            condition, carried = outputs[0], outputs[1:]
            self.require_known(condition, node)
            i += 1
        return carried

    @staticmethod
    def require_known(value, node) -> None:
        if isinstance(value, torch.Tensor):
            raise SystemExit(f"control flow on a tensor's value cannot be retraced: {node}")

    @staticmethod
    def results(node, result) -> List[Any]:
        return [result] if node.outputsSize() == 1 else ([] if node.outputsSize() == 0 else list(result))

    @staticmethod
    def aten(node, args):
        schema = node.schema()
        if schema == "(no schema)":
            raise SystemExit(f"TorchScript node {node.kind()} has no schema to retrace it by: {node}")
        parsed = torch._C.parse_schema(schema)
        packet = getattr(torch.ops.aten, parsed.name.split("::", 1)[1])
        overload = getattr(packet, parsed.overload_name or "default")
        positional, keywords = [], {}
        for argument, value in zip(parsed.arguments, args):
            if argument.kwarg_only:
                keywords[argument.name] = value
            else:
                positional.append(value)
        return overload(*positional, **keywords)
