"""``CIFAR10``: deterministic synthetic 32x32x3 images with CIFAR-10's interface, no download.

Every process builds the same images and labels from a fixed numpy seed (train and test use
different seeds); labels cycle through the 10 classes in a seeded order, so each class is
present whenever there are at least 10 images. Sizes default to 128 train and 16 test images
and can be changed with the environment variables CIFAR_STANDIN_TRAIN and CIFAR_STANDIN_TEST.
Items are ``(image, label)`` with the image an HxWxC uint8 numpy array (the real dataset gives a
PIL image of the same pixels) passed through ``transform``.
"""

from __future__ import annotations

import os

import numpy as np

TRAIN_SEED, TEST_SEED = 1234, 5678


class CIFAR10:
    classes = ["airplane", "automobile", "bird", "cat", "deer",
               "dog", "frog", "horse", "ship", "truck"]

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        count = int(os.environ.get("CIFAR_STANDIN_TRAIN" if train else "CIFAR_STANDIN_TEST",
                                   128 if train else 16))
        rng = np.random.RandomState(TRAIN_SEED if train else TEST_SEED)
        # N x H x W x C, as torchvision's CIFAR10.data
        self.data = rng.randint(0, 256, size=(count, 32, 32, 3), dtype=np.uint8)
        # Every class appears (the script's test() divides by each class's count).
        self.targets = [int(t) for t in rng.permutation(np.arange(count) % 10)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        img, target = self.data[index], self.targets[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target
