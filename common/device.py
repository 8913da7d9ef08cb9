"""Waiting for work an accelerator has queued on a tensor's memory (encoder and consumer processes).

A CUDA kernel returns before it ran. Where another agent reads or writes the same memory
outside the stream that queued it (a NIXL READ over UCX), "written" and "copied out" must mean
done on the device: a consumer could otherwise read rows under tags already stamped, or a
landing block could take the next READ while a copy out of it is still queued.
"""

from __future__ import annotations

import torch


def settle(device: torch.device) -> None:
    """Return once the work this thread queued on ``device`` has run (nothing to wait for on the host).

    The calling thread's current stream only, not the whole device: a consumer pulls in several
    threads, and one pull's copy must not wait for another's.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
