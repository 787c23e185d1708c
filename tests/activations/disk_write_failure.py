"""Run by test_callback.py: a fit with disk offload under a file-size limit (every larger write fails).

Prints one JSON line: the error the fit raised (if any), the steps it ran and what was left on disk.
"""

import json
import os
import resource
import signal
import sys

import lightning
from script_data import Rows
from torch.utils.data import DataLoader

from lightning_efficient import ActivationMemory, DemoGPT
from lightning_efficient.activations import DiskFullError

if __name__ == "__main__":
    offload_dir, limit = sys.argv[1], int(sys.argv[2])
    lightning.seed_everything(0)
    model = DemoGPT(vocab_size=512, n_layers=2, d_model=32, n_heads=2, seq_len=32)
    callback = ActivationMemory(policy="disk", offload_dir=offload_dir, min_offload_bytes=0)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                                callbacks=[callback])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    error = None
    try:
        trainer.fit(model, DataLoader(Rows(), batch_size=4))
    except DiskFullError as caught:
        error = str(caught)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    left = [os.path.join(root, name) for root, dirs, files in os.walk(offload_dir) for name in dirs + files]
    print(json.dumps({"error": error, "global_step": model.global_step, "left": left}))
