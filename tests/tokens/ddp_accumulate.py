"""Run by test_accumulation.py: 2 CPU processes (gloo), accumulation 2, two steps, SelectiveTokenLoss;
rank 0 saves the initial state and each step's gradients.

Usage: python ddp_accumulate.py OUT.pt METHOD SCOPE
"""

import sys

import torch
from accumulation_model import fit

if __name__ == "__main__":
    out, method, scope = sys.argv[1], sys.argv[2], sys.argv[3]
    grads = fit(method, scope, devices=2, strategy="ddp", use_distributed_sampler=False)
    if torch.distributed.get_rank() == 0:
        torch.save({"init": grads.init, "steps": grads.steps, "batches": grads.batches}, out)
