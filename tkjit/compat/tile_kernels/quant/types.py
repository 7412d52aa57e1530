"""TileKernels' `quant.types`: a quantised tensor is its (values, scaling factors) pair."""

import torch

QuantTensor = tuple[torch.Tensor, torch.Tensor]
