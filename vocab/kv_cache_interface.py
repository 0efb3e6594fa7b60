"""What one layer's KV cache looks like (specs) and how a model's KV cache is laid out (config).

A *page* is one block of one layer: `block_size` tokens of K and V (or of one MLA latent). The
manager hands out block ids; each layer keeps a tensor of `num_blocks` pages, indexed by the same
ids, so one logical block costs `page_size_bytes * num_layers` bytes of device memory (in a hybrid
model whose groups share tensors, `page_size_bytes` times the layers of the largest group).

    KVCacheSpec                 block_size
    └── AttentionSpec           + num_kv_heads, head_size, dtype, use_mla -> page_size_bytes
        ├── FullAttentionSpec          keeps every token:   cdiv(max_model_len, B) pages
        ├── SlidingWindowSpec          + sliding_window:    cdiv(min(W-1+T, max_model_len), B) + 1
        └── ChunkedLocalAttentionSpec  + attention_chunk_size: cdiv(min(C+T, max_model_len), B)
    └── MambaSpec               + state shapes, dtypes: one state a page (2 or 3 with prefix
                                  caching), whatever the length; padded to the attention page

A `KVCacheConfig` puts layers with one spec in a `KVCacheGroupSpec` (one block table each) and
gives every layer a `KVCacheTensor`; a hybrid model's groups share tensors position by position
(`KVCacheTensor.shared_by`), so one block id addresses a page in every group's tensors.

Dtypes are accepted as torch dtypes or names and stored as a canonical name (`DTypeName`);
torch is never imported here.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType, TypeAlias

from pagedkv.vocab import refusals
from pagedkv.vocab.arguments import (
    argument_error,
    is_int,
    require_instance,
    require_iterable,
    require_str,
)
from pagedkv.vocab.errors import ArgumentTypeError, InvalidArgumentError, KVCacheConfigError

if TYPE_CHECKING:
    import torch

DTypeName = NewType("DTypeName", str)
"""A canonical dtype name, the one torch prints after `torch.`: "float16", "bfloat16", ..."""

DTypeLike: TypeAlias = "str | torch.dtype"
"""A torch dtype, its canonical name, or an accepted alias ("half", "bf16", "torch.float16")."""

DTYPE_SIZES: Mapping[DTypeName, int] = {
    DTypeName(name): size
    for name, size in (
        ("float64", 8),
        ("float32", 4),
        ("float16", 2),
        ("bfloat16", 2),
        ("float8_e4m3fn", 1),
        ("float8_e4m3fnuz", 1),
        ("float8_e5m2", 1),
        ("float8_e5m2fnuz", 1),
        ("int64", 8),
        ("int32", 4),
        ("int16", 2),
        ("int8", 1),
        ("uint8", 1),
    )
}
"""Bytes per element of every dtype a KV cache may use, by canonical name."""

DTYPE_ALIASES: Mapping[str, DTypeName] = {
    alias: DTypeName(name)
    for alias, name in (
        ("double", "float64"),
        ("float", "float32"),
        ("fp32", "float32"),
        ("half", "float16"),
        ("fp16", "float16"),
        ("bf16", "bfloat16"),
        ("fp8", "float8_e4m3fn"),  # vLLM's kv_cache_dtype "fp8" means e4m3
        ("fp8_e4m3", "float8_e4m3fn"),
        ("fp8_e5m2", "float8_e5m2"),
        ("long", "int64"),
        ("int", "int32"),
        ("short", "int16"),
    )
}
"""Other spellings of a dtype, each mapped to its canonical name."""


def dtype_name(dtype: DTypeLike) -> DTypeName:
    """The canonical name of `dtype`, a torch dtype or a name, without importing torch.

    A torch dtype is recognized by its type (`torch.dtype`) and read through `str()`.

    Raises:
        InvalidArgumentError: `dtype` is neither, or names a dtype not in `DTYPE_SIZES`.

    Complexity: O(1).
    """
    if isinstance(dtype, str):
        text = dtype.strip().lower()
    elif type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        text = str(dtype)
    else:
        raise InvalidArgumentError(
            f"dtype must be a torch dtype or a dtype name, got {dtype!r} ({type(dtype).__name__})"
        )
    text = text.removeprefix("torch.")
    name = DTYPE_ALIASES.get(text, DTypeName(text))
    if name not in DTYPE_SIZES:
        raise InvalidArgumentError(
            f"unknown KV cache dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)} "
            f"(aliases: {', '.join(DTYPE_ALIASES)})"
        )
    return name


def dtype_size(dtype: DTypeLike) -> int:
    """Bytes per element of `dtype` (see `dtype_name`). Complexity: O(1)."""
    return DTYPE_SIZES[dtype_name(dtype)]


def attention_page_size_bytes(
    block_size: int, num_kv_heads: int, head_size: int, dtype_size: int, use_mla: bool
) -> int:
    """Bytes of one block of an attention layer: K and V (or one MLA latent) per token.

    Complexity: O(1).
    """
    coef = 1 if use_mla else 2
    return coef * block_size * num_kv_heads * head_size * dtype_size


def full_attention_max_blocks(max_model_len: int, block_size: int) -> int:
    """Blocks a full-attention layer needs for one request of `max_model_len` tokens.

    Complexity: O(1).
    """
    return -(-max_model_len // block_size)


def sliding_window_max_blocks(
    sliding_window: int, max_model_len: int, max_num_batched_tokens: int, block_size: int
) -> int:
    """Blocks a sliding-window layer needs at most: `cdiv(min(W - 1 + T, L), B) + 1`.

    A step keeps the last W - 1 computed tokens and adds at most T new ones, never more than L
    in all; the window may start mid-block, hence one more block (B = 4, window `CDEF` spans
    `[xxCD][EF..]`).

    Complexity: O(1).
    """
    num_tokens = min(sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return -(-num_tokens // block_size) + 1


def _check_positive_int(name: str, value: object) -> None:
    """Refuse anything but an int >= 1: ArgumentTypeError for another type (a bool, a float)."""
    if not is_int(value):
        raise ArgumentTypeError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:  # type: ignore[operator]
        raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class KVCacheSpec(ABC):
    """The KV cache format of one layer: at least, how many tokens one block holds.

    Attributes:
        block_size: tokens per block (>= 1).
    """

    block_size: int

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)

    @property
    @abstractmethod
    def type_id(self) -> str:
        """Equal for two layers exactly when their KV caches can share one block table."""

    @property
    @abstractmethod
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer."""

    @abstractmethod
    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Bytes this layer needs to serve one request of `max_model_len` tokens.

        Args:
            max_model_len: the longest request, prompt and output together (>= 1).
            max_num_batched_tokens: the most tokens one scheduler step may compute (>= 1).
        """

    def max_admission_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """The most blocks of this layer's group one request holds at once, when its attention
        frees blocks as the request advances (a window, a chunk); None when a request holds a
        block for every token slot. The full-sequence admission gate reserves at most this many
        (vLLM 0.33's `max_admission_blocks_per_request`, the bound its pool sizing uses).

        Args:
            max_model_len: the longest request, prompt and output together.
            max_in_flight_tokens: tokens scheduled but not yet computed, at most (a step's
                token budget, times the steps in flight).

        Complexity: O(1).
        """
        return None


@dataclass(frozen=True, init=False)
class AttentionSpec(KVCacheSpec):
    """An attention layer's KV cache: K and V per token, or one latent vector per token (MLA).

    Page size: `coef * block_size * num_kv_heads * head_size * dtype_size`, coef 2 (K and V) or 1
    (MLA). Validated on construction: sizes >= 1, a known dtype.

    Attributes:
        num_kv_heads: KV heads stored by this layer on this worker (>= 1).
        head_size: elements per head (>= 1); for MLA, the latent vector's width.
        dtype: the cache's element type, canonical name.
        use_mla: the layer stores one latent vector per token instead of K and V.
    """

    num_kv_heads: int
    head_size: int
    dtype: DTypeName
    use_mla: bool

    def __init__(
        self,
        *,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: DTypeLike,
        use_mla: bool = False,
    ) -> None:
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "num_kv_heads", num_kv_heads)
        object.__setattr__(self, "head_size", head_size)
        object.__setattr__(self, "dtype", dtype_name(dtype))
        object.__setattr__(self, "use_mla", use_mla)
        self.__post_init__()

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("num_kv_heads", self.num_kv_heads)
        _check_positive_int("head_size", self.head_size)
        if not isinstance(self.use_mla, bool):
            raise InvalidArgumentError(f"use_mla must be a bool, got {self.use_mla!r}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer (see the class docstring). Complexity: O(1)."""
        return attention_page_size_bytes(
            self.block_size,
            self.num_kv_heads,
            self.head_size,
            DTYPE_SIZES[self.dtype],
            self.use_mla,
        )


@dataclass(frozen=True, init=False)
class FullAttentionSpec(AttentionSpec):
    """A layer that attends to every earlier token, so it keeps every block of a request."""

    @property
    def type_id(self) -> str:
        """`full_attention_{block_size}_{page_size_bytes}`."""
        return f"full_attention_{self.block_size}_{self.page_size_bytes}"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """`cdiv(max_model_len, block_size)` pages; the batch size does not matter.

        Raises:
            InvalidArgumentError: either argument < 1.

        Complexity: O(1).
        """
        _check_positive_int("max_model_len", max_model_len)
        _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        return full_attention_max_blocks(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, init=False)
class SlidingWindowSpec(AttentionSpec):
    """A layer that attends only to the last `sliding_window` tokens (MLA is not supported).

    Attributes:
        sliding_window: tokens each query attends to, itself included (>= 1).
    """

    sliding_window: int

    def __init__(
        self,
        *,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: DTypeLike,
        sliding_window: int,
        use_mla: bool = False,
    ) -> None:
        object.__setattr__(self, "sliding_window", sliding_window)
        super().__init__(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            use_mla=use_mla,
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("sliding_window", self.sliding_window)
        if self.use_mla:
            raise KVCacheConfigError("MLA is not supported with a sliding window")

    @property
    def type_id(self) -> str:
        """`sliding_window_{sliding_window}_{block_size}_{page_size_bytes}`."""
        return f"sliding_window_{self.sliding_window}_{self.block_size}_{self.page_size_bytes}"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """`sliding_window_max_blocks(W, max_model_len, max_num_batched_tokens, B)` pages.

        Raises:
            InvalidArgumentError: either argument < 1.

        Complexity: O(1).
        """
        _check_positive_int("max_model_len", max_model_len)
        _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        num_blocks = sliding_window_max_blocks(
            self.sliding_window, max_model_len, max_num_batched_tokens, self.block_size
        )
        return num_blocks * self.page_size_bytes

    def max_admission_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """`sliding_window_max_blocks(W, max_model_len, max_in_flight_tokens, B)`."""
        return sliding_window_max_blocks(
            self.sliding_window, max_model_len, max_in_flight_tokens, self.block_size
        )


def chunked_local_attention_max_blocks(
    attention_chunk_size: int, max_model_len: int, max_num_batched_tokens: int, block_size: int
) -> int:
    """Blocks a chunked-local layer needs at most: one chunk and the step's tokens,
    `cdiv(min(C + T, L), B)` (vLLM 0.33's bound: blocks are freed as whole chunks pass).

    Complexity: O(1).
    """
    num_tokens = min(attention_chunk_size + max_num_batched_tokens, max_model_len)
    return -(-num_tokens // block_size)


@dataclass(frozen=True, init=False)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """A layer whose tokens attend only within their chunk: token t reads the tokens from
    `t // C * C` to t (Llama-4's local layers). Blocks of earlier chunks are never read again.

    Attributes:
        attention_chunk_size: tokens per chunk (>= 1).
    """

    attention_chunk_size: int

    def __init__(
        self,
        *,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: DTypeLike,
        attention_chunk_size: int,
        use_mla: bool = False,
    ) -> None:
        object.__setattr__(self, "attention_chunk_size", attention_chunk_size)
        super().__init__(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            use_mla=use_mla,
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("attention_chunk_size", self.attention_chunk_size)
        if self.use_mla:
            raise KVCacheConfigError("MLA is not supported with chunked local attention")

    @property
    def type_id(self) -> str:
        """`local_attention_{attention_chunk_size}_{block_size}_{page_size_bytes}`."""
        return (
            f"local_attention_{self.attention_chunk_size}_{self.block_size}_{self.page_size_bytes}"
        )

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """`chunked_local_attention_max_blocks(C, max_model_len, max_num_batched_tokens, B)`
        pages.

        Raises:
            InvalidArgumentError: either argument < 1.

        Complexity: O(1).
        """
        _check_positive_int("max_model_len", max_model_len)
        _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        num_blocks = chunked_local_attention_max_blocks(
            self.attention_chunk_size, max_model_len, max_num_batched_tokens, self.block_size
        )
        return num_blocks * self.page_size_bytes

    def max_admission_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """`chunked_local_attention_max_blocks(C, max_model_len, max_in_flight_tokens, B)`."""
        return chunked_local_attention_max_blocks(
            self.attention_chunk_size, max_model_len, max_in_flight_tokens, self.block_size
        )


MAMBA_CACHE_MODES = ("align", "none")
"""vLLM 0.33's `mamba_cache_mode`: "align" with prefix caching on (its default), else "none"."""


def mamba_state_bytes(shapes: Iterable[Iterable[int]], dtypes: Iterable[DTypeLike]) -> int:
    """Bytes of one request's state in one recurrent layer: each state tensor's elements times
    its dtype's size, summed (vLLM's `MambaSpec.state_content_size_bytes`).

    Complexity: O(elements of `shapes`' tuples).
    """
    return sum(
        math.prod(shape) * dtype_size(dtype) for shape, dtype in zip(shapes, dtypes, strict=True)
    )


@dataclass(frozen=True, init=False)
class MambaSpec(KVCacheSpec):
    """A recurrent layer's state (Mamba-1, Mamba-2, a gated delta net): a fixed number of bytes
    per request, whatever its length. One block holds one whole state.

    The page is the state, or `page_size_padded` (vLLM pads a Mamba page to the attention page,
    so that one block id addresses a page of every group). A request holds at most, with
    prefix caching on (`mamba_cache_mode` "align"), `2 + num_speculative_blocks +
    num_prefill_checkpoint_blocks` blocks: the running state, the last block-aligned one that a
    later request may reuse, a checkpoint taken inside a prefill; otherwise ("none")
    `1 + num_speculative_blocks`. `block_size` is the tokens between reusable states ("align")
    or max_model_len ("none").

    Validated on construction: one dtype per shape, every dimension >= 1, a padded page no
    smaller than the state.

    Attributes:
        shapes: each state tensor's shape for one request on this worker (conv, then ssm).
        dtypes: each state tensor's element type, canonical names.
        page_size_padded: the page when padded past the state, else None.
        mamba_type: the recurrence, as vLLM names its backend ("mamba1", "mamba2", "gdn_attn").
        mamba_cache_mode: "align" or "none" (`MAMBA_CACHE_MODES`).
        num_speculative_blocks: extra states kept for draft tokens (>= 0).
        num_prefill_checkpoint_blocks: states a prefill may checkpoint into (>= 0).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[DTypeName, ...]
    page_size_padded: int | None
    mamba_type: str
    mamba_cache_mode: str
    num_speculative_blocks: int
    num_prefill_checkpoint_blocks: int

    def __init__(
        self,
        *,
        block_size: int,
        shapes: Iterable[Iterable[int]],
        dtypes: Iterable[DTypeLike],
        page_size_padded: int | None = None,
        mamba_type: str = "mamba2",
        mamba_cache_mode: str = "none",
        num_speculative_blocks: int = 0,
        num_prefill_checkpoint_blocks: int = 0,
    ) -> None:
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "shapes", _state_shapes(shapes))
        given_dtypes: list[DTypeLike] = require_iterable("MambaSpec", "dtypes", dtypes)
        object.__setattr__(self, "dtypes", tuple(dtype_name(dtype) for dtype in given_dtypes))
        object.__setattr__(self, "page_size_padded", page_size_padded)
        object.__setattr__(self, "mamba_type", mamba_type)
        object.__setattr__(self, "mamba_cache_mode", mamba_cache_mode)
        object.__setattr__(self, "num_speculative_blocks", num_speculative_blocks)
        object.__setattr__(self, "num_prefill_checkpoint_blocks", num_prefill_checkpoint_blocks)
        self.__post_init__()

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.dtypes) != len(self.shapes):
            raise KVCacheConfigError(
                f"MambaSpec needs one dtype per state shape: {len(self.shapes)} shapes, "
                f"{len(self.dtypes)} dtypes"
            )
        require_str("MambaSpec", "mamba_type", self.mamba_type)
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise InvalidArgumentError(
                f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, got "
                f"{self.mamba_cache_mode!r}"
            )
        for name in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise argument_error("MambaSpec", name, "an int >= 0", value, type_ok=is_int(value))
        if self.page_size_padded is not None:
            _check_positive_int("page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.state_size_bytes:
                raise KVCacheConfigError(
                    f"page_size_padded={self.page_size_padded:,} is smaller than the "
                    f"{self.state_size_bytes:,}-byte state: a padded page holds the whole state"
                )

    @property
    def state_size_bytes(self) -> int:
        """Bytes of the state itself (see `mamba_state_bytes`). Complexity: O(len(shapes))."""
        return mamba_state_bytes(self.shapes, self.dtypes)

    @property
    def page_size_bytes(self) -> int:
        """`page_size_padded`, or the state when not padded. Complexity: O(len(shapes))."""
        return self.state_size_bytes if self.page_size_padded is None else self.page_size_padded

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request holds at most (see the class docstring). Complexity: O(1)."""
        if self.mamba_cache_mode == "align":
            return 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        return 1 + self.num_speculative_blocks

    @property
    def type_id(self) -> str:
        """`mamba_{mamba_type}_{mamba_cache_mode}_{blocks_per_request}_{block_size}_{page}`."""
        return (
            f"mamba_{self.mamba_type}_{self.mamba_cache_mode}_{self.blocks_per_request}_"
            f"{self.block_size}_{self.page_size_bytes}"
        )

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """`blocks_per_request` pages, whatever the request's length.

        Raises:
            InvalidArgumentError: either argument < 1.

        Complexity: O(len(shapes)).
        """
        _check_positive_int("max_model_len", max_model_len)
        _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        return self.blocks_per_request * self.page_size_bytes


def _state_shapes(shapes: object) -> tuple[tuple[int, ...], ...]:
    """`shapes` as a non-empty tuple of non-empty tuples of ints >= 1."""
    rule = "a non-empty collection of shapes, each a non-empty tuple of ints >= 1"
    if isinstance(shapes, (str, bytes)):
        raise argument_error("MambaSpec", "shapes", rule, shapes, type_ok=False)
    result: list[tuple[int, ...]] = []
    given: list[object] = require_iterable("MambaSpec", "shapes", shapes)
    for index, shape in enumerate(given):
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise argument_error("MambaSpec", f"shapes[{index}]", rule, shape, type_ok=False)
        dims = tuple(shape)
        for dim in dims:
            if not is_int(dim):
                raise argument_error("MambaSpec", f"shapes[{index}]", rule, shape, type_ok=False)
        if not dims or min(dims) < 1:
            raise argument_error("MambaSpec", f"shapes[{index}]", rule, shape, type_ok=True)
        result.append(dims)
    if not result:
        raise argument_error("MambaSpec", "shapes", rule, shapes, type_ok=True)
    return tuple(result)


@dataclass(frozen=True, init=False)
class KVCacheTensor:
    """Device memory for the KV cache of one layer, or of one layer of each of several groups.

    Groups of a hybrid model share tensors position by position (vLLM's `shared_by`): the i-th
    layer of every group reads and writes the same tensor. That is sound because block ids come
    from one pool and each id belongs to one group at a time, so two layers sharing a tensor
    never use the same page at once; layers of one group never share one.

    Attributes:
        size: bytes (>= 1): a whole number of pages of the spec of every layer that uses it.
        shared_by: the layers that use this tensor when several groups share it (no repeats);
            empty for the tensor of one layer, the one `KVCacheConfig.tensors` maps to it.
    """

    size: int
    shared_by: tuple[str, ...]

    def __init__(self, size: int, shared_by: Iterable[str] = ()) -> None:
        _check_positive_int("KVCacheTensor.size", size)
        names = _layer_names("KVCacheTensor", "shared_by", shared_by)
        if len(set(names)) != len(names):
            raise KVCacheConfigError(f"KVCacheTensor.shared_by names a layer twice: {names}")
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "shared_by", names)


def _layer_names(call: str, argument: str, value: object) -> tuple[str, ...]:
    """`value` as a tuple of layer names: any iterable of str but a str itself."""
    if isinstance(value, (str, bytes)):
        raise argument_error(call, argument, "a collection of layer names", value, type_ok=False)
    names: list[object] = require_iterable(call, argument, value)
    for index, name in enumerate(names):
        require_str(call, f"{argument}[{index}]", name)
    return tuple(names)  # type: ignore[arg-type]


@dataclass(frozen=True, init=False)
class KVCacheGroupSpec:
    """Layers that share one block table, because they share one KV cache spec.

    Attributes:
        layer_names: the layers, in model order (at least one, no repeats).
        kv_cache_spec: the spec every one of them has.
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __init__(self, layer_names: Iterable[str], kv_cache_spec: KVCacheSpec) -> None:
        names = _layer_names("KVCacheGroupSpec", "layer_names", layer_names)
        if not names:
            raise KVCacheConfigError("a KV cache group needs at least one layer")
        if len(set(names)) != len(names):
            raise KVCacheConfigError(f"a KV cache group names a layer twice: {names}")
        if not isinstance(kv_cache_spec, KVCacheSpec):
            raise argument_error(
                "KVCacheGroupSpec", "kv_cache_spec", "a KVCacheSpec", kv_cache_spec, type_ok=False
            )
        object.__setattr__(self, "layer_names", names)
        object.__setattr__(self, "kv_cache_spec", kv_cache_spec)


@dataclass(frozen=True, init=False)
class KVCacheConfig:
    """A model's KV cache on one worker: how many blocks, each layer's tensor, the groups.

    Every layer of every group has exactly one tensor, holding a whole number of its spec's pages
    and at least `num_blocks` of them (after multi-worker unification a tensor may hold more
    pages than `num_blocks`; only the first `num_blocks` are used). A tensor with `shared_by`
    is the same tensor for every layer it names, and those layers are in different groups.
    Checked on construction; arguments of the wrong type raise `ArgumentTypeError`.

    Block sizes may differ between groups (a hybrid model whose page sizes were unified by
    growing the smaller pages' block size): `block_sizes` lists them, `scheduler_block_size`
    and `hash_block_size` are what vLLM 0.33 derives from them, and `block_size` exists only
    while they agree.

    Attributes:
        num_blocks: blocks the manager may hand out ids for, the null block included (>= 1).
        tensors: layer name -> its tensor (a private copy of the mapping given).
        kv_cache_groups: the groups, each layer in exactly one.
        prefix_cache_retention_interval: which full blocks of a sliding-window group are put
            in the prefix cache (vLLM 0.33's name and meaning; a keyword argument). None:
            every one (dense, vLLM 0.33's `KVCacheConfig` default); 0: only those a later hit
            can start its window in, at the prompt's replay boundaries and a detected
            shared-prefix junction (the default of vLLM 0.33's engine); a positive multiple of
            `scheduler_block_size`: those too, and the window-long tail of every segment of
            that many tokens. Full-attention and chunked groups always cache every full block.
            `pagedkv.spec.retention` states the rule.
    """

    num_blocks: int
    tensors: dict[str, KVCacheTensor]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    prefix_cache_retention_interval: int | None

    def __init__(
        self,
        num_blocks: int,
        tensors: Mapping[str, KVCacheTensor],
        kv_cache_groups: Iterable[KVCacheGroupSpec],
        *,
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        _check_positive_int("num_blocks", num_blocks)
        if not isinstance(tensors, Mapping):
            raise argument_error(
                "KVCacheConfig",
                "tensors",
                "a mapping of layer name to KVCacheTensor",
                tensors,
                type_ok=False,
            )
        copied = dict(tensors)
        for name, tensor in copied.items():
            require_str("KVCacheConfig", "a layer name in tensors", name)
            require_instance("KVCacheConfig", f"tensors[{name!r}]", tensor, KVCacheTensor)
        if isinstance(kv_cache_groups, (str, bytes, KVCacheGroupSpec)):
            raise argument_error(
                "KVCacheConfig",
                "kv_cache_groups",
                "a collection of KVCacheGroupSpec",
                kv_cache_groups,
                type_ok=False,
            )
        groups: list[object] = require_iterable("KVCacheConfig", "kv_cache_groups", kv_cache_groups)
        for index, group in enumerate(groups):
            require_instance("KVCacheConfig", f"kv_cache_groups[{index}]", group, KVCacheGroupSpec)
        object.__setattr__(self, "num_blocks", num_blocks)
        object.__setattr__(self, "tensors", copied)
        object.__setattr__(self, "kv_cache_groups", tuple(groups))
        interval = prefix_cache_retention_interval
        if interval is not None and not is_int(interval):
            raise argument_error(
                "KVCacheConfig",
                "prefix_cache_retention_interval",
                "None or an int",
                interval,
                type_ok=False,
            )
        object.__setattr__(self, "prefix_cache_retention_interval", interval)
        self._validate()

    def _validate(self) -> None:
        if not self.kv_cache_groups:
            raise KVCacheConfigError("a KV cache config needs at least one group")
        grouped: dict[str, KVCacheSpec] = {}
        group_of: dict[str, int] = {}
        for index, group in enumerate(self.kv_cache_groups):
            for name in group.layer_names:
                if name in grouped:
                    raise KVCacheConfigError(f"layer {name!r} is in more than one group")
                grouped[name] = group.kv_cache_spec
                group_of[name] = index
        if grouped.keys() != self.tensors.keys():
            raise KVCacheConfigError(
                f"layers in groups and layers with tensors differ: "
                f"without a tensor {sorted(grouped.keys() - self.tensors.keys())}, "
                f"in no group {sorted(self.tensors.keys() - grouped.keys())}"
            )
        for name, tensor in self.tensors.items():
            page_size = grouped[name].page_size_bytes
            if tensor.size % page_size or tensor.size // page_size < self.num_blocks:
                raise KVCacheConfigError(
                    f"layer {name!r}: tensor of {tensor.size} bytes is not a whole number of "
                    f"{page_size}-byte pages, at least num_blocks={self.num_blocks} of them"
                )
            if tensor.shared_by:
                self._check_shared(name, tensor, group_of)
        self._check_retention()

    def _check_retention(self) -> None:
        """vLLM 0.33's rule, in its order: any interval is refused but None and 0 when no group
        is a sliding window or Mamba (nothing would act on it); then it must be >= 0 and a
        multiple of `scheduler_block_size`, so that its segments end where hits can."""
        interval = self.prefix_cache_retention_interval
        if interval is None:
            return
        sparse = (SlidingWindowSpec, MambaSpec)
        if not any(isinstance(g.kv_cache_spec, sparse) for g in self.kv_cache_groups):
            if interval == 0:
                return
            raise refusals.retention_without_sparse_group(interval)
        block = self.scheduler_block_size
        if interval < 0 or interval % block:
            raise refusals.retention_off_the_block_grid(interval, block)

    def _check_shared(self, name: str, tensor: KVCacheTensor, group_of: dict[str, int]) -> None:
        if name not in tensor.shared_by:
            raise KVCacheConfigError(
                f"layer {name!r} maps to a tensor shared by {list(tensor.shared_by)}, "
                f"which does not name it"
            )
        for other in tensor.shared_by:
            if self.tensors.get(other) != tensor:
                raise KVCacheConfigError(
                    f"layers {name!r} and {other!r} must map to the one tensor shared by "
                    f"{list(tensor.shared_by)}"
                )
            if other != name and group_of[other] == group_of[name]:
                raise KVCacheConfigError(
                    f"layers {name!r} and {other!r} share a tensor but are both in group "
                    f"{group_of[name]}: a group's layers use the same block ids at once"
                )

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer, group by group. Complexity: O(num_layers)."""
        return tuple(name for group in self.kv_cache_groups for name in group.layer_names)

    @property
    def kv_cache_tensors(self) -> tuple[KVCacheTensor, ...]:
        """Each tensor once (a shared one once for all its layers), in the order of the first
        layer that uses it, group by group. Complexity: O(num_layers)."""
        distinct: list[KVCacheTensor] = []
        shared: set[KVCacheTensor] = set()
        for name in self.layer_names:
            tensor = self.tensors[name]
            if tensor.shared_by:
                if tensor in shared:
                    continue
                shared.add(tensor)
            distinct.append(tensor)
        return tuple(distinct)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Each group's block size, in group order. Complexity: O(groups)."""
        return tuple(group.kv_cache_spec.block_size for group in self.kv_cache_groups)

    @property
    def block_size(self) -> int:
        """Tokens per block, equal across groups (one block id space).

        Raises:
            KVCacheConfigError: the groups disagree (see `block_sizes`).
        """
        sizes = set(self.block_sizes)
        if len(sizes) != 1:
            raise KVCacheConfigError(f"groups have different block sizes: {sorted(sizes)}")
        return sizes.pop()

    @property
    def scheduler_block_size(self) -> int:
        """The LCM of the groups' block sizes: vLLM 0.33 rounds computed tokens and cache hits
        to it (`resolve_kv_cache_block_sizes`). Complexity: O(groups)."""
        return math.lcm(*self.block_sizes)

    @property
    def hash_block_size(self) -> int:
        """The GCD of the groups' block sizes: the tokens per block hash vLLM 0.33 computes with
        prefix caching on, so that every group's blocks are whole hashes. Complexity:
        O(groups)."""
        return math.gcd(*self.block_sizes)

    def with_num_blocks(self, num_blocks: int) -> KVCacheConfig:
        """A copy with `num_blocks` replaced (tensors unchanged, so it must not exceed them).

        Raises:
            InvalidArgumentError, KVCacheConfigError: as on construction.

        Complexity: O(num_layers).
        """
        return KVCacheConfig(
            num_blocks,
            self.tensors,
            self.kv_cache_groups,
            prefix_cache_retention_interval=self.prefix_cache_retention_interval,
        )

    def with_retention(self, interval: int | None) -> KVCacheConfig:
        """A copy with `prefix_cache_retention_interval` replaced.

        Raises:
            ArgumentTypeError, KVCacheConfigError: as on construction.

        Complexity: O(num_layers).
        """
        return KVCacheConfig(
            self.num_blocks,
            self.tensors,
            self.kv_cache_groups,
            prefix_cache_retention_interval=interval,
        )


def uniform_kv_cache_config(
    kv_cache_spec: KVCacheSpec, num_blocks: int, num_layers: int = 1
) -> KVCacheConfig:
    """One group of `num_layers` layers ("layers.0", ...) sharing `kv_cache_spec`, each with a
    tensor of exactly `num_blocks` pages: the shape `KVCacheManager` and tests build from.

    Raises:
        InvalidArgumentError, KVCacheConfigError: as `KVCacheConfig` on construction.

    Complexity: O(num_layers).
    """
    _check_positive_int("num_layers", num_layers)
    _check_positive_int("num_blocks", num_blocks)
    names = tuple(f"layers.{i}" for i in range(num_layers))
    tensor = KVCacheTensor(size=kv_cache_spec.page_size_bytes * num_blocks)
    return KVCacheConfig(
        num_blocks,
        dict.fromkeys(names, tensor),
        [KVCacheGroupSpec(names, kv_cache_spec)],
    )
