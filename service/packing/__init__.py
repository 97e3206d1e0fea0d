"""cuDNN canonical packed weight layout: offsets, packing and unpacking."""
from .layout import LayoutEntry, block_layout, block_param_count
from .pack import LayerWeights, pack_block, unpack_block

__all__ = ["LayoutEntry", "block_layout", "block_param_count", "LayerWeights", "pack_block", "unpack_block"]
