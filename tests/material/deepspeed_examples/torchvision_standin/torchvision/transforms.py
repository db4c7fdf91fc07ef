"""``Compose``, ``ToTensor`` and ``Normalize``: torchvision's semantics, for HxWxC uint8 images."""

from __future__ import annotations

import numpy as np
import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, img):
        for t in self.transforms:
            img = t(img)
        return img


class ToTensor:
    """An HxWxC uint8 array (a numpy array, or anything ``np.asarray`` reads, such as a PIL
    image) -> a CxHxW float32 tensor in [0, 1], as torchvision's ``ToTensor`` does."""

    def __call__(self, pic):
        array = np.asarray(pic)
        if array.ndim == 2:
            array = array[:, :, None]
        if array.dtype != np.uint8 or array.ndim != 3:
            raise TypeError(f"ToTensor stand-in expects an HxWxC uint8 image, got "
                            f"{array.dtype} of shape {array.shape}")
        tensor = torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))
        return tensor.to(torch.float32).div(255)


class Normalize:
    """Per channel ``(x - mean) / std``, as torchvision's ``Normalize`` does."""

    def __init__(self, mean, std, inplace=False):
        self.mean, self.std, self.inplace = mean, std, inplace

    def __call__(self, tensor):
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        if not self.inplace:
            tensor = tensor.clone()
        return tensor.sub_(mean).div_(std)
