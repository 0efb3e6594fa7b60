"""A Mamba hybrid as pagedkv plans it: which layers attend, which keep a recurrent state, and
how large that state is on each GPU, as vLLM 0.33 sizes it (`mamba_utils.py`).

A Mamba or linear-attention layer keeps, per request, a fixed state instead of K and V per
token: the inputs of its short convolution (the last `conv_kernel - 1` of them) and the
recurrence's state. vLLM 0.33's shapes (conv state as (state_len, dim), its default layout),
with I the inner width, N the state size, G the groups, H the heads of P channels, K the
convolution kernel, tp the GPUs:

    Mamba-1 (Jamba)            conv (K - 1, I / tp)                    ssm (I / tp, N)
    Mamba-2 (Nemotron-H,       conv (K - 1, (I + 2 G N) / tp)          ssm (H / tp, P, N)
      Falcon-H1, Granite-4.0-H)  G raised to tp when tp does not divide it
    gated delta net            conv (K - 1, (2 Hk Dk + Hv Dv) / tp)    ssm (Hv / tp, Dv, Dk)
      (Qwen3-Next)

Both states take the Mamba cache dtype (the model's, "auto"); the ssm state may take its own
(`mamba_ssm_cache_dtype`; "auto" is the conv state's, except Nemotron-H's, which is the
config's `mamba_ssm_cache_dtype`, float32 by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pagedkv.planning.byte_sizes import format_bytes
from pagedkv.planning.plan import FULL_ATTENTION, ModelShape
from pagedkv.vocab.errors import InvalidArgumentError
from pagedkv.vocab.kv_cache_interface import DTypeName, mamba_state_bytes

MAMBA_MODEL_TYPES = ("jamba", "falcon_h1", "nemotron_h", "granitemoehybrid", "qwen3_next")
"""The model types whose recurrent layers pagedkv plans, as vLLM 0.33 does
(`pagedkv.planning.hf_mamba` reads their config.json)."""

LINEAR_ATTENTION = "linear_attention"
"""transformers' layer type of a recurrent layer (Mamba, a gated delta net)."""

HYBRID = "hybrid"
"""transformers' layer type of a layer with both an attention and a Mamba block (Falcon-H1)."""

MLP = "mlp"
MOE = "moe"
"""transformers' layer types of Nemotron-H's layers without attention or state."""

ATTENTION_KINDS = (FULL_ATTENTION, HYBRID)
STATE_KINDS = (LINEAR_ATTENTION, HYBRID)

MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")
"""vLLM 0.33's `--mamba-cache-dtype` and `--mamba-ssm-cache-dtype` choices."""


def divide(numerator: int, tensor_parallel_size: int, what: str) -> int:
    """`numerator / tensor_parallel_size`, which must be whole (vLLM's `divide`).

    Raises:
        InvalidArgumentError: it is not; the message names `what` is split.
    """
    if numerator % tensor_parallel_size:
        raise InvalidArgumentError(
            f"tensor_parallel_size={tensor_parallel_size} must divide {what}={numerator}: "
            f"each GPU keeps the same share of every recurrent state"
        )
    return numerator // tensor_parallel_size


@dataclass(frozen=True)
class Mamba1State:
    """A Mamba-1 layer's state (Jamba): inner width, state size, convolution kernel."""

    intermediate_size: int
    state_size: int
    conv_kernel: int

    mamba_type: ClassVar[str] = "mamba1"
    name: ClassVar[str] = "Mamba-1"

    def shapes(self, tensor_parallel_size: int) -> tuple[tuple[int, ...], ...]:
        """(conv, ssm) for one request on one of `tensor_parallel_size` GPUs.

        Raises:
            InvalidArgumentError: tensor_parallel_size does not divide the inner width.
        """
        width = divide(self.intermediate_size, tensor_parallel_size, "the Mamba inner width")
        return (self.conv_kernel - 1, width), (width, self.state_size)


@dataclass(frozen=True)
class Mamba2State:
    """A Mamba-2 layer's state (Nemotron-H, Falcon-H1, Granite-4.0-H)."""

    intermediate_size: int
    n_groups: int
    num_heads: int
    head_dim: int
    state_size: int
    conv_kernel: int

    mamba_type: ClassVar[str] = "mamba2"
    name: ClassVar[str] = "Mamba-2"

    def shapes(self, tensor_parallel_size: int) -> tuple[tuple[int, ...], ...]:
        """(conv, ssm) for one request on one of `tensor_parallel_size` GPUs; groups that tp
        does not divide are replicated up to tp (vLLM's `extra_groups_for_head_shards`).

        Raises:
            InvalidArgumentError: tensor_parallel_size does not divide the heads or the
                convolution's width.
        """
        tp = tensor_parallel_size
        groups = self.n_groups if self.n_groups % tp == 0 else tp
        conv_dim = self.intermediate_size + 2 * groups * self.state_size
        return (
            (self.conv_kernel - 1, divide(conv_dim, tp, "the Mamba convolution width")),
            (divide(self.num_heads, tp, "the Mamba heads"), self.head_dim, self.state_size),
        )


@dataclass(frozen=True)
class GatedDeltaNetState:
    """A gated delta net's state (Qwen3-Next's linear attention): key and value heads and
    their widths, convolution kernel."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    mamba_type: ClassVar[str] = "gdn_attn"
    name: ClassVar[str] = "gated delta net"

    def shapes(self, tensor_parallel_size: int) -> tuple[tuple[int, ...], ...]:
        """(conv, ssm) for one request on one of `tensor_parallel_size` GPUs.

        Raises:
            InvalidArgumentError: tensor_parallel_size does not divide the value heads or the
                convolution's width.
        """
        tp = tensor_parallel_size
        conv_dim = 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim
        return (
            (self.conv_kernel - 1, divide(conv_dim, tp, "the linear-attention convolution width")),
            (divide(self.num_v_heads, tp, "the value heads"), self.head_v_dim, self.head_k_dim),
        )


RecurrentState = Mamba1State | Mamba2State | GatedDeltaNetState


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(f"{dim:,}" for dim in shape) + ")"


@dataclass(frozen=True)
class MambaHybridModel:
    """A model with recurrent-state layers (and, usually, attention layers), read from its
    config.json (`pagedkv.planning.hf_mamba`).

    Attributes:
        model_type: the config's model type.
        layer_types: each decoder layer's type, as transformers names it: `FULL_ATTENTION`,
            `LINEAR_ATTENTION` (a recurrent state), `HYBRID` (both: Falcon-H1), `MLP`, `MOE`.
        attention: the attention layers' shape (num_layers = the attention layers), None
            when there are none.
        state: the recurrent layers' state.
        state_dtypes: the conv and the ssm state's dtypes.
        model_dtype: the dtype vLLM runs the weights in.
        max_position_embeddings: the model's longest sequence, None if the config has none.
        notes: what the reading assumed, one sentence each.
    """

    model_type: str
    layer_types: tuple[str, ...]
    attention: ModelShape | None
    state: RecurrentState
    state_dtypes: tuple[DTypeName, DTypeName]
    model_dtype: DTypeName
    max_position_embeddings: int | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        attention = self.attention_layers
        if self.attention is None and attention:
            raise InvalidArgumentError(f"{len(attention)} attention layers need a shape")
        if self.attention is not None and self.attention.num_layers != len(attention):
            raise InvalidArgumentError(
                f"the attention shape has {self.attention.num_layers} layers, layer_types "
                f"{len(attention)}"
            )
        if not self.state_layers:
            raise InvalidArgumentError("a Mamba hybrid needs at least one recurrent layer")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with attention, in model order."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in ATTENTION_KINDS)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers with a recurrent state, in model order."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in STATE_KINDS)

    def state_shapes(self, tensor_parallel_size: int) -> tuple[tuple[int, ...], ...]:
        """Each state tensor's shape for one request on one GPU (see `RecurrentState`)."""
        return self.state.shapes(tensor_parallel_size)

    def state_bytes(self, tensor_parallel_size: int) -> int:
        """One layer's state for one request on one GPU."""
        return mamba_state_bytes(self.state_shapes(tensor_parallel_size), self.state_dtypes)

    def describe_state(self, tensor_parallel_size: int) -> str:
        """ "Mamba-1: conv (3, 8,192) bfloat16 + ssm (8,192, 16) bfloat16 = 311,296 bytes ..."."""
        conv, ssm = self.state_shapes(tensor_parallel_size)
        conv_dtype, ssm_dtype = self.state_dtypes
        return (
            f"{self.state.name}: conv {_shape_text(conv)} {conv_dtype} + ssm {_shape_text(ssm)} "
            f"{ssm_dtype} = {format_bytes(self.state_bytes(tensor_parallel_size))} per layer "
            f"and request"
        )

    def describe(self) -> str:
        """One line: layers, their kinds, the attention heads and dtype."""
        num_state = len(self.state_layers)
        num_attention = len(self.attention_layers)
        if self.attention is None:
            return f"{len(self.layer_types)} layers, {num_state} {self.state.name}, no attention"
        both = self.layer_types.count(HYBRID)
        if both == len(self.layer_types):
            kinds = f"each {self.state.name} + full attention"
        else:
            kinds = f"{num_state} {self.state.name} + {num_attention} full attention"
            others = len(self.layer_types) - len(set(self.attention_layers + self.state_layers))
            if others:
                kinds += f" + {others} MLP or MoE"
        heads = f"{self.attention.num_kv_heads} KV heads x {self.attention.head_size}"
        return f"{len(self.layer_types)} layers, {kinds}, {heads}, {self.attention.dtype}"

    def as_json(self, tensor_parallel_size: int) -> dict[str, Any]:
        """The `model` object of `pagedkv plan --json` for this model."""
        attention = self.attention
        return {
            "description": self.describe(),
            "model_type": self.model_type,
            "num_layers": len(self.layer_types),
            "layer_types": list(self.layer_types),
            "num_attention_layers": len(self.attention_layers),
            "num_state_layers": len(self.state_layers),
            "num_full_attention_layers": len(self.attention_layers),
            "num_sliding_window_layers": 0,
            "sliding_window": None,
            "num_chunked_local_layers": 0,
            "attention_chunk_size": None,
            "num_attention_heads": None if attention is None else attention.num_attention_heads,
            "num_kv_heads": None if attention is None else attention.num_kv_heads,
            "head_size": None if attention is None else attention.head_size,
            "use_mla": False,
            "kv_cache_dtype": None if attention is None else attention.dtype,
            "model_dtype": self.model_dtype,
            "state_kind": self.state.mamba_type,
            "state_shapes": [list(shape) for shape in self.state_shapes(tensor_parallel_size)],
            "state_dtypes": list(self.state_dtypes),
            "state_bytes": self.state_bytes(tensor_parallel_size),
        }
