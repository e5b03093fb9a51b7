"""The worker environment the warm path needs on NCCL, and what in an environment defeats
it. Free of torch, so the launcher sets it without importing torch.

Read from torch 2.13's ``ProcessGroupNCCL`` (its header lists the variables and the error
handling modes) and nvidia-resiliency-ext's in-process restart docs; run with one rank on
one GPU (``tests/gpu``), never with two or more (:mod:`llmtrain.distributed.failure`).
The launcher sets, where the user has not:

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly). torchrun's agent sets 1
  (TearDown) when this is unset. With 1, on a timeout or an NCCL async error from a dead
  peer, the watchdog thread aborts the communicators and then ends the process, so every
  survivor dies before its ``except`` runs. 3, the default outside torchrun, also ends the
  process. With 2 the watchdog only aborts: the aborted collective's kernels end, and
  the next collective on the aborted communicator raises ``DistBackendError`` in the
  training thread, which goes into recovery.
- ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``: the watchdog would otherwise rethrow a CUDA
  error it meets while polling work. That is on its own thread, which ends the process.
  A rank whose CUDA context failed still fails in its training thread, as a local error.
- ``NCCL_NVLS_ENABLE=0``: NVLink SHARP's multicast buffers are not reliably released by
  an abort, and re-creating communicators on the same devices then fails or hangs (as
  nvidia-resiliency-ext documents for its in-process restart). The cost is NVLS-accelerated
  all-reduce on NVSwitch systems; FSDP's all-gathers and reduce-scatters keep their rings.
- ``TORCH_NCCL_BLOCKING_WAIT`` stays unset. It would make every wait a host sync, and
  the overlap of communication with computation would be lost.
"""

from __future__ import annotations

from collections.abc import MutableMapping

WARM_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
                 "NCCL_NVLS_ENABLE": "0"}

# Values of TORCH_NCCL_ASYNC_ERROR_HANDLING that end the process on a peer's failure.
_TEARS_DOWN = {"1", "3"}


def warm_worker_env(env: MutableMapping[str, str]) -> dict[str, str]:
    """Sets the warm path's worker settings in ``env`` (a launcher's, for torchrun or a
    spare) where the user has not set them; returns those it set."""
    new = {k: v for k, v in WARM_NCCL_ENV.items() if k not in env}
    env.update(new)
    return new


def env_problems(env: MutableMapping[str, str]) -> list[str]:
    """The settings in ``env`` that defeat the warm path on NCCL, each with what to do."""
    problems = []
    handling = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if handling in _TEARS_DOWN:
        problems.append(f"TORCH_NCCL_ASYNC_ERROR_HANDLING={handling} ends every survivor on a "
                        f"peer's failure; unset it (llmtrain launch sets 2) or set 2")
    if env.get("TORCH_NCCL_RETHROW_CUDA_ERRORS", "1") != "0":
        problems.append("TORCH_NCCL_RETHROW_CUDA_ERRORS is not 0: a CUDA error seen by "
                        "NCCL's watchdog thread ends the process; unset it (llmtrain launch "
                        "sets 0) or set 0")
    return problems
