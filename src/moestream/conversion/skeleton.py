"""The model as transformers defines it, built without allocating weights, and its experts modules.

Both the converter (to learn every parameter's name, shape and role) and the runtime (to assemble the
model it serves) start from the same skeleton: a transformers causal-LM built on the meta device.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..errors import SourceError, StoreError


def load_source_config(src: Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """Read a checkpoint's config.json, refusing custom modeling code unless the user allowed it."""
    path = Path(src) / "config.json"
    if not path.is_file():
        raise SourceError(f"{src} has no config.json; pass a Hugging Face checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path} is not valid JSON ({e}); the checkpoint is damaged, download it again") from None
    if not isinstance(raw, dict):
        raise SourceError(f"{path} is not a JSON object; the checkpoint is damaged, download it again")
    if "auto_map" in raw and not trust_remote_code:
        raise SourceError(
            f"{path} names custom modeling code (auto_map); moestream runs only transformers' own model "
            "definitions. Pass --trust-remote-code if you trust this checkpoint's code."
        )
    if raw.get("model_type") not in CONFIG_MAPPING:
        raise SourceError(
            f"{path}: model_type {raw.get('model_type')!r} is not known to this transformers version; "
            "upgrade transformers or check the checkpoint."
        )
    try:
        return AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # config classes validate with their own error types (huggingface_hub's strict dataclasses)
        raise SourceError(f"{path} is not a valid {raw.get('model_type')} config ({e}); check the checkpoint") from None


def config_from_dict(raw: dict) -> PretrainedConfig:
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise StoreError(f"the store's model_type {model_type!r} is unknown to this transformers version; upgrade it")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(raw))
    except Exception as e:  # config classes validate with their own error types (huggingface_hub's strict dataclasses)
        raise StoreError(f"the store's model_config is not a valid {model_type} config ({e}); convert the model again") from None


def model_dtype(config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def build_skeleton(config: PretrainedConfig, dtype: torch.dtype, experts_implementation: str | None = None) -> nn.Module:
    """A transformers causal LM with every parameter and buffer on the meta device (no memory used)."""
    kwargs = {"dtype": dtype}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except ValueError as e:
            raise SourceError(f"transformers cannot build a causal LM for model_type {config.model_type!r}: {e}") from None
    return model.eval()


def is_experts_module(module: nn.Module) -> bool:
    # transformers' @use_experts_implementation sets these on every experts module it wraps; they are what
    # routes the module's forward through the ExpertsInterface we register into.
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "is_transposed") and hasattr(module, "num_experts")


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = [(name, m) for name, m in model.named_modules() if is_experts_module(m)]
    if not found:
        raise SourceError(
            f"{type(model).__name__} has no experts module that uses transformers' ExpertsInterface; "
            "moestream streams the experts of MoE models only."
        )
    return found


def expert_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's own per-expert parameters (leading dimension = num_experts), in definition order."""
    return [(name, p) for name, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == module.num_experts]


def dense_linears(model: nn.Module) -> list[tuple[str, nn.Linear, bool]]:
    """The resident linear layers `--dense-dtype` may quantize, each with whether it is the LM head:
    attention projections, shared experts, dense MLP layers, and an LM head not tied to the embeddings
    (stored at 8 bits at least: its logits decide every token). Not a router written as an nn.Linear (its
    top-k decides which experts run)."""
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    routers = set()
    for name, module in experts_modules(model):
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        routers |= {
            id(child) for child in parent.children() if isinstance(child, nn.Linear) and child.out_features == module.num_experts
        }
    return [
        (name, m, m is output)
        for name, m in model.named_modules()
        # Exactly nn.Linear: a subclass has a forward of its own (DeepSeek-V4's grouped o_a_proj), which a
        # plain quantized matmul would not compute.
        if type(m) is nn.Linear and id(m) not in routers and not (m is output and tied)
    ]
