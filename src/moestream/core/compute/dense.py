"""Resident linear layers stored quantized (`convert --dense-dtype int8|int4`), and a GGUF's quantized token
embedding kept quantized: the modules that run them.

The converter quantizes the weight of each linear that conversion.skeleton.dense_linears names and
stores it in the layout its kernel consumes (quant.py), so loading is a plain state-dict load: `install`
swaps those nn.Linear modules of the meta-device skeleton for QuantizedLinear before the weights arrive.
Each one's plan (plan.py, `LinearPlan`) runs the experts' kernel table (kernels.py), so the dense path and
the experts run the same code.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ...conversion.quant import QuantFormat, stored_codes
from ...errors import StoreError
from .kernels import table_values
from .repack import kernel_layout


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W [out, in] held as `qweight` plus `scales` (int8) or `scales_zeros` (int4)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, fmt: QuantFormat):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        # Meta tensors of the record's exact shapes and dtypes; load_state_dict(assign=True) replaces them.
        for name, dtype, shape in fmt.record_specs("w", out_features, in_features):
            self.register_buffer(name.removeprefix("w."), torch.empty(shape, dtype=dtype, device="meta"))
        self.bias = bias
        self.plan = None  # how it computes: a plan.LinearPlan, given at load (plan.plan_linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = self.plan.matmul(rows, self.qweight, getattr(self, self.fmt.params))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.fmt.group_size}" if self.fmt.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt.name}{group}"


class QuantizedEmbedding(nn.Module):
    """The token embedding held as `qweight` plus `scales_zeros` (int4, or a table format) or `scales` (int8), as the
    converter keeps a GGUF's quantized token embedding (not a bf16 copy two to six times its size). Each
    looked-up row is dequantized as the format defines it (quant.reference_dequantize), in float32, then
    given the model's compute dtype (`dtype`, set by `set_compute_dtype`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: QuantFormat):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.fmt = num_embeddings, embedding_dim, fmt
        for name, dtype, shape in fmt.record_specs("w", num_embeddings, embedding_dim):
            self.register_buffer(name.removeprefix("w."), torch.empty(shape, dtype=dtype, device="meta"))
        self.dtype = torch.float32

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.fmt.name == "int8":
            rows = self.qweight[ids].float() * self.scales[ids, None].float()
        else:
            codes = stored_codes(self.qweight[ids], self.fmt)
            # a table format's codes stand for its values; the int4 family's for code - 8 (quant.py)
            values = table_values(self.fmt.name)[codes.long()] if self.fmt.table is not None else codes.float() - 8
            scales_zeros = self.scales_zeros[:, ids].float()  # [K/G, T, 2]
            s, z = scales_zeros[..., 0].t()[..., None], scales_zeros[..., 1].t()[..., None]
            rows = (values.float().view(len(ids), -1, self.fmt.group_size) * s + z).view(len(ids), self.embedding_dim)
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        group = f", group_size={self.fmt.group_size}" if self.fmt.group_size else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt.name}{group}"


def install(model: nn.Module, formats: dict[str, QuantFormat]) -> None:
    """Swap the named nn.Linear modules of a meta-device skeleton for QuantizedLinear, and a named token
    embedding for QuantizedEmbedding."""
    for name, fmt in formats.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        parent, _, child = name.rpartition(".")
        if type(module) is nn.Embedding and module is model.get_input_embeddings():
            quantized = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, fmt)
            setattr(model.get_submodule(parent) if parent else model, child, quantized)
            continue
        if type(module) is not nn.Linear:  # a subclass has its own forward (skeleton.dense_linears)
            raise StoreError(
                f"the store quantized {name}, which is not a plain linear layer or the token embedding of this model; "
                "convert it again"
            )
        quantized = QuantizedLinear(module.in_features, module.out_features, module.bias, fmt)
        setattr(model.get_submodule(parent) if parent else model, child, quantized)


def embedding_output(model: nn.Module) -> tuple[int, torch.dtype]:
    """The width and dtype of what the token embedding hands the first layer (the model's compute dtype
    once `set_compute_dtype` ran), whether it is a plain or a quantized embedding."""
    embedding = model.get_input_embeddings()
    if isinstance(embedding, QuantizedEmbedding):
        return embedding.embedding_dim, embedding.dtype
    return embedding.weight.shape[-1], embedding.weight.dtype


def prepare_for_cpu(model: nn.Module) -> None:
    """On the CPU, once at load, after the plans (plan.plan_linears): the portable int4 weights of the
    linears whose plan takes float activations become the layout of torch's CPU int4 kernel (repack.py);
    int8-activation kernels read them as stored, and a version 3 store's weights are in it already."""
    for module in model.modules():
        if not isinstance(module, QuantizedLinear) or module.plan.int8_activations:
            continue
        if module.fmt.bits == 4 and module.fmt.portable and module.fmt.table is None:  # tables: read as stored
            module.qweight = kernel_layout(module.qweight)


def align_weights(model: nn.Module, alignment: int = 64) -> None:
    """Give each quantized weight its own `alignment`-byte aligned memory. safetensors hands back tensors
    at whatever offset they sit in the file, and torch's bf16 int8 kernel reads past or crashes on a
    weight 8 bytes off (a segmentation fault, seen with torch 2.13); torch's own allocations are aligned."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.data_ptr() % alignment:
                    setattr(module, name, buffer.clone())


def routers_in_float32(routers) -> None:
    """Make routers compute in float32 on the CPU: their weights held as a float32 copy, their input cast.

    Why: a one-token bf16 matmul as narrow as a router (experts x hidden) costs 2-3x a float32 one on the
    CPU (oneDNN repacks the weight on every call; docs/DECISIONS.md, "Routers in float32 on the CPU"), and
    DeepSeek's routers cast their weight to float32 on every call anyway. llama.cpp keeps routers in
    float32 too. The router's outputs are then float32, which the experts call takes as it is (its output
    has the hidden states' dtype). The copy costs layers x experts x hidden x 2 bytes more than bf16."""
    for router in routers:
        if router is None or router.weight.dtype == torch.float32:
            continue
        for name, p in router.named_parameters(recurse=False):
            if p.is_floating_point():
                setattr(router, name, nn.Parameter(p.detach().float(), requires_grad=False))
        router.forward = functools.partial(float32_router_forward, router)


def float32_router_forward(router: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """A float32 router's forward on bf16 or float16 hidden states: cast up, then the router's own. (An
    instance forward rather than a pre-hook: any hook sends every call of the module down nn.Module's slow
    path, a few microseconds per layer and token.)"""
    return type(router).forward(router, float32_input(router, hidden_states), *args, **kwargs)


def float32_input(router: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The router's input as routers_in_float32 has it computed: half-precision input cast up to a float32
    weight."""
    if router.weight.dtype == torch.float32 and hidden_states.dtype in (torch.bfloat16, torch.float16):
        return hidden_states.float()
    return hidden_states


def set_compute_dtype(model: nn.Module, stored: torch.dtype, dtype: torch.dtype) -> None:
    """Make the model compute in `dtype`: float weights stored as `stored` are cast (tied ones stay tied),
    and int8 scales, stored as float32, take the activations' dtype once here rather than at every call.
    int4 scales and zeros stay bf16: the int4 kernel reads them so."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, QuantizedEmbedding):  # its rows take the dtype as they are looked up
            module.dtype = dtype
            continue
        if isinstance(module, QuantizedLinear):
            if module.fmt.name == "int8":
                module.scales = module.scales.to(dtype)
        for name, p in module.named_parameters(recurse=False):
            if p.dtype == stored and stored != dtype:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                setattr(module, name, cast[id(p)])
        if isinstance(module, QuantizedLinear):
            continue
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.dtype == stored and stored != dtype:
                setattr(module, name, b.to(dtype))
