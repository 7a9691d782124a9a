"""Read checkpoint files without running code from them.

A ``.pt`` file is a pickle, and unpickling with ``torch.load(..., weights_only=False)`` can call
any function the file names: a checkpoint downloaded from someone else could run arbitrary code
when a user only wants to inspect it. The checkpoint tools therefore read every file with
``weights_only=True`` (tensors, containers, numbers, strings) plus an explicit allowlist of what
that kind of file holds (for DeepSpeed's, the few classes below); anything else is refused with a
one-line ``ValueError`` that names the file and what it asked for, and nothing from it runs. The
zip format and torch's legacy (non-zip) format are read alike.

(A run resuming from its own checkpoints goes through DeepSpeed's ``load_checkpoint``, which trusts
the files it reads: see ``megatron_multilevel.training.checkpoint.load``.)
"""

import contextlib
import pickle
import re

import torch

DEEPSPEED = "a DeepSpeed checkpoint of this project"


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
    """One DeepSpeed file on the CPU, restricted to tensors and ``allowed_classes``."""
    return load_restricted(path, allowed_classes(), DEEPSPEED, mmap=mmap)


def load_restricted(path: str, allowed, holder: str, *, mmap: bool = False):
    """``torch.load`` of ``path`` on the CPU with ``weights_only=True`` and exactly ``allowed`` beyond
    torch's own types; ``holder`` says what kind of file it is. Raises a one-line ``ValueError``
    naming the file and the class or function it refers to outside the allowlist."""
    try:
        with only_safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise ValueError(refusal(path, e, allowed, holder)) from None
    except (RuntimeError, EOFError) as e:
        if mmap and "mmap" in str(e):  # mmap needs the zip format; read a legacy file without it
            return load_restricted(path, allowed, holder)
        raise ValueError(f"{path} is not a readable checkpoint file ({_line(e)})") from None


@contextlib.contextmanager
def only_safe_globals(allowed):
    """Exactly ``allowed`` beyond torch's defaults for ``weights_only`` loads: the classes other
    libraries register process-wide (Megatron-Core adds ``argparse.Namespace``, numpy arrays,
    ``PosixPath``, ...) are set aside."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(list(allowed))
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)


def _line(error: Exception) -> str:
    """The informative line of a (torch, often many-line) error message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return next((line for line in lines if "nsupported" in line), lines[0])


def refusal(path: str, error: Exception, allowed, holder: str) -> str:
    """The one-line refusal of a file whose ``weights_only`` load failed with ``error``."""
    allowed_names = {_name(c) for c in allowed}
    names = set(re.findall(r"GLOBAL ([\w.]+)", str(error))) - allowed_names  # both formats' messages
    try:  # a static scan of the pickle's opcodes (zip format): nothing is run
        names |= set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - allowed_names
    except Exception:
        pass
    what = ", ".join(sorted(names)) if names else f"something else ({_line(error)})"
    return (f"refused to read {path}: it asks to load {what}, which is not among the classes {holder} holds "
            f"({', '.join(sorted(allowed_names)) or 'tensors and containers only'}); nothing from it was run "
            f"(unpickling it could execute code)")
