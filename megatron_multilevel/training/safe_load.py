"""Read DeepSpeed checkpoint files without running code from them.

A ``.pt`` file is a pickle, and unpickling with ``torch.load(..., weights_only=False)`` can call
any function the file names: a checkpoint downloaded from someone else could run arbitrary code
when a user only wants to inspect it. The checkpoint tools therefore read every file with
``weights_only=True`` (tensors, containers, numbers, strings) plus an explicit allowlist of the
few DeepSpeed classes its checkpoints hold; anything else is refused with an error that names
what the file asked for, and nothing from it runs.

(A run resuming from its own checkpoints goes through DeepSpeed's ``load_checkpoint``, which trusts
the files it reads: see ``megatron_multilevel.training.checkpoint.load``.)
"""

import contextlib
import pickle
import re

import torch


def allowed_classes() -> list:
    """The non-torch classes pickled into this project's DeepSpeed checkpoints (DeepSpeed 0.19)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [
        LossScaler,         # fp32 and bf16 optimizer states ("loss_scaler")
        DynamicLossScaler,  # fp16 optimizer states
        ZeroStageEnum,      # optimizer states of ZeRO 1-3 ("zero_stage")
        fragment_address,   # model states of ZeRO 1-2 ("param_slice_mappings")
    ]


def _name(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def load_checkpoint_file(path: str, *, mmap: bool = False) -> dict:
    """``torch.load`` of one DeepSpeed file on the CPU, restricted to tensors and the allowlist.

    Raises ``ValueError`` naming the class or function a file refers to outside the allowlist."""
    allowed = allowed_classes()
    try:
        with _only_safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise ValueError(_refusal(path, e, allowed)) from None
    except RuntimeError as e:
        if "mmap" not in str(e) or not mmap:  # mmap needs the zip format; retry a legacy file without it
            raise ValueError(f"{path} is not a readable checkpoint file ({e})") from None
        return load_checkpoint_file(path, mmap=False)


@contextlib.contextmanager
def _only_safe_globals(allowed: list):
    """Exactly ``allowed`` beyond torch's defaults: the classes other libraries register process-wide
    (Megatron-Core adds ``argparse.Namespace``, numpy arrays, ``PosixPath``, ...) are set aside."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)


def _refusal(path: str, error: Exception, allowed: list) -> str:
    names = set()
    try:  # a static scan of the pickle's opcodes: nothing is run
        names = set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - {_name(c) for c in allowed}
    except Exception:
        pass
    names |= set(re.findall(r"GLOBAL ([\w.]+) was not an allowed global", str(error)))
    what = ", ".join(sorted(names)) if names else f"something else ({str(error).splitlines()[0]})"
    return (f"refused to read {path}: it asks to load {what}, which is not among the classes a DeepSpeed "
            f"checkpoint of this project holds ({', '.join(_name(c) for c in allowed)}); nothing from it was run "
            f"(unpickling it could execute code)")
