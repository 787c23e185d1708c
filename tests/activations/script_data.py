"""Data the activation scripts launched as processes share."""

import torch


class Rows(torch.utils.data.Dataset):
    """16 reproducible rows of 32 demo tokens (ids and labels below 512)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 512, (32,), generator=g), "labels": torch.randint(0, 512, (32,), generator=g)}
