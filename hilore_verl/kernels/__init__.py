"""Codecs for saved activations. `quantize` dispatches by device: torch reference on CPU tensors.

The Triton kernels for CUDA tensors plug in behind the same signature; until they land, CUDA
tensors use the torch reference as well.
"""

from hilore_verl.kernels.reference import FORMATS, GROUP_SIZES, QuantizedTensor, dequantize, quantize

__all__ = ["FORMATS", "GROUP_SIZES", "QuantizedTensor", "dequantize", "quantize"]
