"""Host data onto the device without waiting for the device.

A plain ``tensor.to(cuda)`` from ordinary (pageable) host memory is a blocking copy: torch
synchronizes the stream after it, so the host waits for everything queued before the copy. In
the step loop that is the previous step's whole forward pass: the host cannot build step N+1
while step N runs, and the device idles while it does. Staging through pinned memory lets the
copy queue behind the work already launched; torch's pinned-memory cache keeps each staging
block until its copy has run, so the host array may be dropped at once.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: np.ndarray | list | tuple, device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a numpy array, shared on the CPU, or a list converted as torch.tensor would) as
    a tensor on `device`, queued on the current stream without a host wait."""
    host = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
