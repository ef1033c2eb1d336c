"""Type stubs of the extension module cudapool._torch_fakecuda (csrc/fakecuda/fakecuda_module.cpp):
the fake GPU below Python, built against the installed torch (pybind11) and driven by
cudapool.fakegpu.native. Tensors are ``Any`` here: the stubs do not import torch."""

from typing import Any, Callable, Dict, Sequence, Tuple

#: The torch version the module was built against (``torch.__version__``).
torch_version: str

def install(
    devices: int,
    workspace_bytes: int,
    read: Callable[[str, Any], object],
    scratch: Callable[[str, Tuple[Any, ...], Dict[str, Any]], Sequence[int]],
    sdp_choice: Callable[[Tuple[Any, ...], Dict[str, Any]], int],
    scratch_ops: Sequence[str],
    whole_process: bool = False,
) -> int: ...
def uninstall() -> None: ...
def append_records(records: bytearray) -> int: ...

#: Bytes of one record the fake device writes (core/trace_event.h's cp_trace_event_t).
record_size: int
#: (field, byte offset, byte size) of each field of a record, in order.
record_layout: Tuple[Tuple[str, int, int], ...]

def counts() -> Dict[str, int]: ...
def set_device(device: int) -> None: ...
def current_device() -> int: ...
def set_stream(stream: int) -> None: ...
def current_stream() -> int: ...
def resize_storage(storage: Any, nbytes: int) -> None: ...
