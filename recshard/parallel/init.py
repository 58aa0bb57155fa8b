"""Initialization of sharded parameters as slices of one full initialization.

Every rank builds the full ("master") tensor with the same random generator state and keeps
its slice, so a layer built after `torch.manual_seed(s)` holds exactly the slice of the
single-process layer built after `torch.manual_seed(s)`. This costs one full tensor per rank
at construction time, which is what dense tensor-parallel layers can afford.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Tuple

import torch
from torch import Tensor, nn

from recshard.parallel.mappings import all_gather
from recshard.parallel.utils import ProcessGroup, ShardSpec, shard_spec_of, take_shard, unstride

InitMethod = Callable[[Tensor], Any]


@torch.no_grad()
def linear_master_params(
    in_features: int,
    out_features: int,
    bias: bool,
    init_method: InitMethod | None,
    device: Any = None,
    dtype: torch.dtype | None = None,
) -> Tuple[Tensor, Tensor | None]:
    """Full weight [out, in] and bias [out] (or None).

    `init_method=None` draws them as `nn.Linear` does (same generator calls, same order);
    otherwise `init_method(weight)` fills the weight and the bias starts at zero.
    """
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    full_bias = torch.empty(out_features, device=device, dtype=dtype) if bias else None
    if init_method is None:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if full_bias is not None:
            bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
            nn.init.uniform_(full_bias, -bound, bound)
    else:
        init_method(weight)
        if full_bias is not None:
            full_bias.zero_()
    return weight, full_bias


@torch.no_grad()
def embedding_master_weight(
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: int | None,
    init_method: InitMethod | None,
    device: Any = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Full table [V, D], drawn as `nn.Embedding` does (N(0, 1), padding row zero) unless
    `init_method` is given (then it fills the table; the padding row is still zeroed)."""
    weight = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
    if init_method is None:
        nn.init.normal_(weight)
    else:
        init_method(weight)
    if padding_idx is not None:
        weight[padding_idx].zero_()
    return weight


def shard_parameter(full: Tensor, spec: ShardSpec, requires_grad: bool = True) -> nn.Parameter:
    """A Parameter holding this rank's slice of `full`, tagged with `spec`."""
    param = nn.Parameter(take_shard(full.detach(), spec), requires_grad=requires_grad)
    param.shard_spec = spec  # type: ignore[attr-defined]
    return param


@torch.no_grad()
def gather_master(shard: Tensor, pg: ProcessGroup | None) -> Tensor:
    """The full tensor of a sharded parameter (collective: every rank of `pg` must call).
    Unsharded tensors come back as a detached clone."""
    spec = shard_spec_of(shard)
    if spec is None or spec.world_size == 1:
        return shard.detach().clone()
    gathered = all_gather(shard.detach(), spec.dim, pg)
    return unstride(gathered, spec.dim, spec.world_size, spec.stride)


class MasterParams:
    """`master_weight` / `master_bias` of a parallel linear: the full tensors, gathered where
    sharded, cloned where replicated (collective: every rank must read them)."""

    weight: Tensor
    bias: Tensor | None
    pg: ProcessGroup | None

    @property
    def master_weight(self) -> Tensor:
        """The full weight [out, in]."""
        return gather_master(self.weight, self.pg)

    @property
    def master_bias(self) -> Tensor | None:
        """The full bias [out] or None."""
        return None if self.bias is None else gather_master(self.bias, self.pg)


@torch.no_grad()
def shard_init_helper_(init_method: Callable[..., Any], tensor: Tensor, **kwargs: Any) -> Tensor:
    """Initialize a (possibly sharded) tensor in place as its slice of one full initialization.

    `init_method(full, **kwargs)` runs on a full-size tensor (so fan-in/fan-out are those of
    the whole layer), then this rank's slice is copied into `tensor`. Tensors without a
    shard spec are initialized directly. Every rank must hold the same generator state.
    Example: `shard_init_helper_(nn.init.kaiming_normal_, layer.weight, a=0, mode="fan_in")`.
    """
    spec = shard_spec_of(tensor)
    if spec is None or spec.world_size == 1:
        init_method(tensor, **kwargs)
        return tensor
    full = torch.empty(spec.full_shape(tensor.shape), dtype=tensor.dtype, device=tensor.device)
    init_method(full, **kwargs)
    tensor.copy_(take_shard(full, spec))
    return tensor
