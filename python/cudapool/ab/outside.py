"""GPU memory a rank of a multi-GPU job holds outside PyTorch's caching allocator, for the "fits"
and "smallest GPU memory" of ``ab --simulate``: the CUDA context of its process and the buffers
of its NCCL communicators, estimated from the GPU model and the environment. docs/ab.md
("Memory outside PyTorch's allocator") gives the model and each default's source."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence

from .._units import MIB, format_bytes

if TYPE_CHECKING:  # the fake GPU's package imports torch; this module needs only the fields
    from ..fakegpu.models import GPUModel

__all__ = ["Communicator", "OutsideEstimate", "context_bytes", "estimate_outside"]

KIB = 1 << 10


class Communicator(NamedTuple):
    """A process group's NCCL communicator, as one of its ranks sees it."""

    size: int  # ranks in the group
    local: int  # of them on this rank's node (including itself)
    nodes: int  # nodes the group spans


class OutsideEstimate(NamedTuple):
    """What :func:`estimate_outside` found, in bytes, and one sentence per part for people."""

    context: int  # the CUDA context of the process
    nccl: int  # all communicators' buffers
    per_communicator: List[int]  # each, in the order given
    lines: List[str]  # one sentence per part: what it counts, about how much, from what

    @property
    def total(self) -> int:
        return self.context + self.nccl


# -- the CUDA context ------------------------------------------------------------------------------

# Note [CUDA context estimate]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A process with CUDA up holds, before its first tensor: the driver's and runtime's own memory, the
# code of the kernels loaded so far, and a stack for every thread the GPU can run at once, which
# the driver sets aside when the context is made. So: a fixed part + multiprocessors x threads per
# multiprocessor x the stack + the kernels a training step loads. The fixed part is chosen so that
# an A100 (216 MiB of stacks) comes to the 300-400 MB that PyTorch's maintainers quote with lazy
# loading; the kernels of cuBLAS, cuDNN and NCCL that a step calls are our allowance, not measured.
# H100: 192 + 264 + 64 = 520 MiB; T4: 296 MiB. Sources in docs/ab.md.

_CONTEXT_FIXED = 192 * MIB
_STACK_PER_THREAD = 1 * KIB  # cudaLimitStackSize's default (CUDA runtime API, cudaDeviceSetLimit)
_STEP_KERNELS = 64 * MIB
_EAGER_EXTRA = 600 * MIB  # every kernel of every library at start: pytorch#86509, pytorch#107667


def _module_loading(env: Mapping[str, str]) -> str:
    """CUDA_MODULE_LOADING as CUDA reads it: torch sets LAZY when unset, DEFAULT is LAZY since 12.2."""
    text = env.get("CUDA_MODULE_LOADING", "").strip().upper() or "LAZY"
    if text not in ("LAZY", "EAGER", "DEFAULT"):
        raise ValueError(f"CUDA_MODULE_LOADING={env['CUDA_MODULE_LOADING']!r}: expected LAZY, EAGER or DEFAULT")
    return "EAGER" if text == "EAGER" else "LAZY"


def context_bytes(gpu: GPUModel, env: Mapping[str, str]) -> int:
    """The CUDA context of one process on ``gpu`` (Note [CUDA context estimate])."""
    threads = gpu.multi_processor_count * gpu.max_threads_per_multi_processor
    eager = _EAGER_EXTRA if _module_loading(env) == "EAGER" else 0
    return _CONTEXT_FIXED + threads * _STACK_PER_THREAD + _STEP_KERNELS + eager


# -- NCCL ------------------------------------------------------------------------------------------

# Note [NCCL buffers per communicator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Read from NCCL 2.30.7 (torch 2.14's wheels bring it; files under its src/). On each channel a
# rank holds connections to a few peers; a connection each way has a buffer per protocol (LL,
# LL128, Simple; all three whatever NCCL_PROTO says). We count, per communicator of 2+ ranks:
# - ring: per channel one send and one receive connection ("a pair"); tree (3+ ranks): the same
#   neighbours the other way round, one more pair; ceil(channels / local ranks) of them cross nodes;
# - NVLS (NVSwitch, 9.0+, 2+ local ranks): one multicast buffer per local rank (each a head);
# - send/recv, when the caller says with how many peers: a pair on each of a local peer's
#   channels; remote peers share one pool each way.
# NCCL connects an algorithm when it first uses it: we count those a training job is likely to use.

_STEPS = 8  # NCCL_STEPS (include/device.h)
_LL = 8 * 512 * _STEPS * 16  # lines a thread x threads x steps x 16 B: 512 KiB (init.cc)
_LL128 = 120 * 640 * _STEPS * 8  # elements a thread x threads x steps x 8 B: 4.69 MiB (init.cc)
_SIMPLE = 4 * MIB  # DEFAULT_BUFFSIZE (init.cc)
_HEADER = 4 * KIB  # ncclSendMem / ncclRecvMem, padded to MEM_ALIGN (include/comm.h)
_IPC_MIN = 2 * MIB  # CUDA_IPC_MIN (include/comm.h): each connection's GPU memory is rounded to it
_NVLS_CHUNK = 128 * KIB  # NCCL_NVLS_CHUNKSIZE's default (transport/nvls.cc)
_NVLS_MAX_HEADS = 32  # NCCL_MAX_NVLS_ARITY (include/device.h)
_P2P_NET_CHUNK = 128 * KIB  # NCCL_P2P_NET_CHUNKSIZE's default (init.cc)
_SHARED_STEPS = 16  # NCCL_SHARED_STEPS (transport/net.cc): slots of a channel in the shared pool
_MAXCHANNELS = 64  # MAXCHANNELS (include/device.h)
_ALGORITHMS = frozenset({"ring", "tree", "collnet", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat"})
_GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")


class _Settings(NamedTuple):
    ll: int
    ll128: int
    simple: int
    min_channels: int
    max_channels: int
    min_ctas: int
    max_ctas: int
    nvls: bool
    nvls_channels: int  # 0: NCCL's default for the GPU
    nvls_chunk: int
    algorithms: FrozenSet[str]
    gdr: Optional[bool]  # None: NCCL's default (on NVLink boards, which come with RDMA NICs)
    gdr_read: Optional[bool]
    max_p2p_channels: int
    p2p_net_chunk: int


def _int(env: Mapping[str, str], name: str, default: int, low: int = 0, high: Optional[int] = None) -> int:
    """An integer variable as NCCL reads it (decimal or 0x hex); ValueError naming it otherwise."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bounds = f"{low} to {high}" if high is not None else f"{low} or more"
        raise ValueError(f"{name}={env[name]!r}: expected an integer, {bounds}")
    return value


def _algorithms(text: str) -> FrozenSet[str]:
    """The algorithms NCCL_ALGO lets some collective use: ``[function:]list`` entries split by ';',
    a list starting with '^' excludes. An entry naming a function leaves the others at NCCL's
    default, so a first entry that names one allows every algorithm somewhere."""
    allowed = set() if text.strip() else set(_ALGORITHMS)
    for i, entry in enumerate(text.split(";")):
        function, _, names = entry.rpartition(":")
        if i == 0 and function.strip():
            allowed |= _ALGORITHMS
        names = names.strip().lower()
        listed = {n.strip() for n in names.lstrip("^").split(",") if n.strip()}
        if listed - _ALGORITHMS:
            known = ", ".join(sorted(_ALGORITHMS))
            raise ValueError(f"NCCL_ALGO={text!r}: unknown algorithm {sorted(listed - _ALGORITHMS)[0]!r} ({known})")
        allowed |= (_ALGORITHMS - listed) if names.startswith("^") else listed
    return frozenset(allowed)


def _settings(env: Mapping[str, str]) -> _Settings:
    level = env.get("NCCL_NET_GDR_LEVEL", "").strip().upper()
    if level and level not in _GDR_LEVELS and not level.isdigit():
        raise ValueError(f"NCCL_NET_GDR_LEVEL={env['NCCL_NET_GDR_LEVEL']!r}: expected one of {', '.join(_GDR_LEVELS)}")
    read = _int(env, "NCCL_NET_GDR_READ", -1, 0, 1)
    return _Settings(
        ll=_int(env, "NCCL_LL_BUFFSIZE", _LL, 1),
        ll128=_int(env, "NCCL_LL128_BUFFSIZE", _LL128, 1),
        simple=_int(env, "NCCL_BUFFSIZE", _SIMPLE, 1),
        min_channels=min(_MAXCHANNELS, max(_int(env, "NCCL_MIN_NCHANNELS", 0), _int(env, "NCCL_MIN_CTAS", 0))),
        max_channels=min(_int(env, "NCCL_MAX_NCHANNELS", _MAXCHANNELS, 1), _int(env, "NCCL_MAX_CTAS", _MAXCHANNELS, 1)),
        min_ctas=min(_MAXCHANNELS, _int(env, "NCCL_MIN_CTAS", 0)),
        max_ctas=_int(env, "NCCL_MAX_CTAS", _MAXCHANNELS, 1),
        nvls=_int(env, "NCCL_NVLS_ENABLE", 2, 0, 2) != 0,
        nvls_channels=_int(env, "NCCL_NVLS_NCHANNELS", 0, 1),
        nvls_chunk=_int(env, "NCCL_NVLS_CHUNKSIZE", _NVLS_CHUNK, 1),
        algorithms=_algorithms(env.get("NCCL_ALGO", "")),
        gdr=None if not level else level not in ("LOC", "0"),
        gdr_read=None if read < 0 else bool(read),
        max_p2p_channels=_int(env, "NCCL_MAX_P2P_NCHANNELS", _MAXCHANNELS, 1),
        p2p_net_chunk=_int(env, "NCCL_P2P_NET_CHUNKSIZE", _P2P_NET_CHUNK, 1),
    )


def _rounded(n: int) -> int:
    return -(-n // _IPC_MIN) * _IPC_MIN


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _channels(gpu: GPUModel, c: Communicator, s: _Settings) -> int:
    """Ring channels: about one ring per NVLink link (at most 16; one over PCIe), doubled
    (graph/connect.cc); across nodes at most 16, which the NICs set; then NCCL_MIN/MAX_NCHANNELS."""
    rings = 2 * max(1, min(gpu.nvlinks, 16))
    if c.nodes > 1:
        rings = min(rings, 16)
    return max(min(rings, s.max_channels), s.min_channels)


def _gdr(gpu: GPUModel, s: _Settings) -> bool:
    return s.gdr if s.gdr is not None else gpu.nvlinks > 0


def _local_pair(gpu: GPUModel, s: _Settings) -> int:
    """A send and a receive connection within the node (transport/p2p.cc): the receiver holds the
    three buffers, the sender a header; on A100 NVLink NCCL reads, so Simple sits with the sender."""
    if (gpu.major, gpu.minor) == (8, 0) and gpu.nvlinks:
        return _rounded(_HEADER + s.simple) + _rounded(_HEADER + s.ll + s.ll128)
    return _rounded(_HEADER) + _rounded(_HEADER + s.ll + s.ll128 + s.simple)


def _net_pair(gpu: GPUModel, s: _Settings) -> int:
    """A send and a receive connection across nodes (transport/net.cc): in GPU memory only with
    GPUDirect RDMA, the receiver's three buffers and, when sends read the GPU (8.0 and later,
    NCCL_NET_GDR_READ), the sender's LL128 and Simple."""
    if not _gdr(gpu, s):
        return 0
    read = s.gdr_read if s.gdr_read is not None else gpu.major >= 8
    return _rounded(s.ll + s.ll128 + s.simple) + (_rounded(s.ll128 + s.simple) if read else 0)


def _communicator(gpu: GPUModel, c: Communicator, s: _Settings, peers: int) -> Dict[str, int]:
    """Bytes of one communicator, by what holds them (Note [NCCL buffers per communicator])."""
    if c.size < 1 or not 1 <= c.local <= c.size or not 1 <= c.nodes <= c.size - c.local + 1:
        raise ValueError(f"{c}: expected 1 <= local <= size and 1 <= nodes <= size - local + 1")
    if (c.nodes == 1) != (c.local == c.size):
        raise ValueError(f"{c}: a group on one node has all its ranks local, and only such a group")
    if not 0 <= peers < c.size:
        raise ValueError(f"{peers} send/recv peers in a communicator of {c.size} ranks")
    parts: Dict[str, int] = {}
    if c.size == 1:
        return parts
    channels = _channels(gpu, c, s)
    crossing = -(-channels // c.local) if c.nodes > 1 else 0
    per_pass = (channels - crossing) * _local_pair(gpu, s) + crossing * _net_pair(gpu, s)
    if "ring" in s.algorithms:
        parts["ring"] = per_pass
    if "tree" in s.algorithms and c.size > 2:
        parts["tree"] = per_pass
    nvls = "nvlstree" if c.nodes > 1 else "nvls"
    if s.nvls and gpu.nvswitch and gpu.major >= 9 and c.local >= 2 and nvls in s.algorithms:
        # transport/nvls.cc: channels x 2 x chunk x steps per head, and a credit buffer
        n = s.nvls_channels or (16 if gpu.major < 10 else 32 if c.nodes > 1 else 24)
        n = max(min(n, s.max_ctas), s.min_ctas)
        heads = min(c.local, _NVLS_MAX_HEADS)
        parts["NVLS"] = _rounded(n * 2 * s.nvls_chunk * _STEPS * heads) + _IPC_MIN
    if peers:
        # graph/paths.cc: p2p channels are the rings' rounded up to a power of two; a local peer
        # gets twice its NVLink links' worth, two over PCIe, four when the network sets them
        p2p = _pow2(min(channels, s.max_p2p_channels))
        per_peer = 4 if c.nodes > 1 else _pow2(2 * gpu.nvlinks) if gpu.nvswitch else 2
        local = min(peers, c.local - 1)
        parts["send/recv"] = local * min(per_peer, p2p) * _local_pair(gpu, s)
        if peers > local and _gdr(gpu, s):  # one pool each way for all remote peers (init.cc, net.cc)
            chunk = min(s.p2p_net_chunk, s.simple // _STEPS)
            parts["send/recv"] += 2 * p2p * _SHARED_STEPS * chunk
    return parts


def _nccl_line(communicators: Sequence[Communicator], kinds: Dict[str, int], total: int, s: _Settings) -> str:
    if not any(c.size > 1 for c in communicators):
        return "NCCL: no communicator of more than one rank: nothing"
    groups = Counter(f"{c.size} rank{'s' * (c.size > 1)} on {c.nodes} node{'s' * (c.nodes > 1)}" for c in communicators)
    named = ", ".join(g if n == 1 else f"{n} x {g}" for g, n in groups.items())
    held = ", ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items() if v) or "all in host memory"
    n = len(communicators)
    return (
        f"NCCL: {n} communicator{'s' * (n > 1)} ({named}): about {format_bytes(total)} ({held}; "
        f"a connection's buffers {format_bytes(s.ll)} LL + {format_bytes(s.ll128)} LL128 + "
        f"{format_bytes(s.simple)} Simple (NCCL_BUFFSIZE); estimate from NCCL 2.30's defaults)"
    )


def estimate_outside(
    gpu: GPUModel,
    communicators: Sequence[Communicator],
    env: Mapping[str, str],
    p2p_peers: Optional[Sequence[int]] = None,
) -> OutsideEstimate:
    """What one rank on ``gpu`` holds outside PyTorch's allocator: its process's CUDA context
    and the buffers of ``communicators`` (its process groups' NCCL communicators), read with the
    CUDA and NCCL variables of ``env``. ``p2p_peers``, when given, says for each communicator with
    how many peers this rank exchanges send/recv (pipelining, all-to-all); none by default.
    ValueError naming the variable for a value CUDA or NCCL would not take."""
    s = _settings(env)
    mode = _module_loading(env)
    context = context_bytes(gpu, env)
    peers = list(p2p_peers) if p2p_peers is not None else [0] * len(communicators)
    if len(peers) != len(communicators):
        raise ValueError(f"{len(peers)} p2p_peers for {len(communicators)} communicators")
    kinds: Dict[str, int] = {}
    each: List[int] = []
    for c, n in zip(communicators, peers):
        parts = _communicator(gpu, c, s, n)
        for k, v in parts.items():
            kinds[k] = kinds.get(k, 0) + v
        each.append(sum(parts.values()))
    sms = f"{gpu.multi_processor_count} multiprocessors x {gpu.max_threads_per_multi_processor} threads"
    ctx = f"CUDA context: about {format_bytes(context)} (estimate for compute capability {gpu.major}.{gpu.minor}, "
    lines = [ctx + f"{sms}, {mode.lower()} module loading)", _nccl_line(communicators, kinds, sum(each), s)]
    return OutsideEstimate(context, sum(each), each, lines)
