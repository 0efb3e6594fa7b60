"""A backend-neutral description of an array: pointer, shape, strides, dtype, device.

The executor takes torch tensors or CuPy arrays (and, for host metadata, NumPy arrays). It
recognizes each by its type's module, so describing an array never imports a library the
caller did not already use. Strides are in elements, as torch reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from pagedkv.vocab.errors import InvalidArgumentError

Backend: TypeAlias = Literal["torch", "cupy", "numpy"]

ArrayLike: TypeAlias = Any
"""A `torch.Tensor`, `cupy.ndarray` or (host metadata only) `numpy.ndarray`."""


@dataclass(frozen=True)
class ArrayView:
    """What the launch code needs to know about one array.

    Attributes:
        name: the argument's name, for error messages.
        backend: the library the array belongs to.
        ptr: address of element 0.
        shape: extents.
        strides: element strides (not bytes).
        dtype: canonical dtype name ("bfloat16", "int32", ...).
        itemsize: bytes per element.
        device: the CUDA device index, or None for host memory.
    """

    name: str
    backend: Backend
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    device: int | None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        total = 1
        for extent in self.shape:
            total *= extent
        return total

    def expect(self, ndim: int, dtypes: tuple[str, ...]) -> None:
        """Check rank and dtype.

        Raises:
            InvalidArgumentError: a different rank or dtype.
        """
        if self.ndim != ndim:
            raise InvalidArgumentError(
                f"{self.name} must have {ndim} dimensions, got shape {self.shape}"
            )
        if self.dtype not in dtypes:
            raise InvalidArgumentError(f"{self.name} must be one of {dtypes}, got {self.dtype}")

    def expect_contiguous(self) -> None:
        """Check row-major contiguity (extent-1 dimensions may have any stride).

        Raises:
            InvalidArgumentError: the array is not contiguous.
        """
        expected = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if extent != 1 and stride != expected:
                raise InvalidArgumentError(
                    f"{self.name} must be contiguous, got shape {self.shape} strides {self.strides}"
                )
            expected *= extent

    def expect_last_dim_contiguous(self) -> None:
        """Check that the last dimension has stride 1.

        Raises:
            InvalidArgumentError: it does not.
        """
        if self.shape[-1] != 1 and self.strides[-1] != 1:
            raise InvalidArgumentError(
                f"{self.name}'s last dimension must be contiguous, got strides {self.strides}"
            )


def backend_of(array: ArrayLike) -> Backend:
    """Which library `array` belongs to, judged by its type's module.

    Raises:
        InvalidArgumentError: it is none of torch, cupy, numpy arrays.
    """
    module = type(array).__module__.split(".")[0]
    if module == "torch" and type(array).__name__ in ("Tensor", "Parameter"):
        return "torch"
    if module == "cupy" and type(array).__name__ == "ndarray":
        return "cupy"
    if module == "numpy" and type(array).__name__ == "ndarray":
        return "numpy"
    raise InvalidArgumentError(
        f"expected a torch.Tensor, cupy.ndarray or numpy.ndarray, got {type(array).__name__}"
    )


def _numpy_like_view(name: str, backend: Backend, array: ArrayLike) -> ArrayView:
    itemsize = int(array.dtype.itemsize)
    byte_strides = tuple(int(s) for s in array.strides)
    if any(s % itemsize for s in byte_strides):
        raise InvalidArgumentError(f"{name} has strides that are not whole elements")
    if backend == "cupy":
        ptr, device = int(array.data.ptr), int(array.device.id)
    else:
        ptr, device = int(array.ctypes.data), None
    return ArrayView(
        name=name,
        backend=backend,
        ptr=ptr,
        shape=tuple(int(e) for e in array.shape),
        strides=tuple(s // itemsize for s in byte_strides),
        dtype=str(array.dtype.name),
        itemsize=itemsize,
        device=device,
    )


def describe(array: ArrayLike, name: str) -> ArrayView:
    """Describe a torch tensor, CuPy array or NumPy array without copying it.

    Args:
        array: the array.
        name: the argument name used in error messages.

    Raises:
        InvalidArgumentError: not an array of a known library.

    Complexity: O(ndim).
    """
    backend = backend_of(array)
    if backend != "torch":
        return _numpy_like_view(name, backend, array)
    return ArrayView(
        name=name,
        backend="torch",
        ptr=int(array.data_ptr()),
        shape=tuple(int(e) for e in array.shape),
        strides=tuple(int(s) for s in array.stride()),
        dtype=str(array.dtype).removeprefix("torch."),
        itemsize=int(array.element_size()),
        device=int(array.device.index) if array.is_cuda else None,
    )


def to_host(array: ArrayLike) -> Any:
    """A NumPy copy (or view, for NumPy input) of `array`; synchronizes a device array.

    Complexity: O(numel).
    """
    backend = backend_of(array)
    if backend == "numpy":
        return array
    if backend == "cupy":
        return array.get()
    return array.detach().cpu().numpy()
