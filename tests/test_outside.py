"""The estimate of GPU memory outside PyTorch's allocator (cudapool.ab.outside): the CUDA context
and NCCL's buffers, against the figures the model is built from; no GPU needed."""

import pytest
from cudapool.ab.outside import Communicator, estimate_outside
from cudapool.fakegpu import gpu_model

MiB = 1 << 20
H100, A100, L4 = gpu_model("H100"), gpu_model("A100"), gpu_model("L4")
NODE8 = Communicator(8, 8, 1)


def nccl(gpu, comm, env=None, peers=None):
    est = estimate_outside(gpu, [comm], env or {}, p2p_peers=None if peers is None else [peers])
    assert est.nccl == sum(est.per_communicator)
    return est.per_communicator[0]


def test_context_follows_the_gpu_and_module_loading():
    est = estimate_outside(H100, [], {})
    assert est.context == 520 * MiB and est.nccl == 0 and est.total == est.context
    assert estimate_outside(gpu_model("T4"), [], {}).context < est.context
    assert estimate_outside(H100, [], {"CUDA_MODULE_LOADING": "lazy"}).context == est.context
    assert estimate_outside(H100, [], {"CUDA_MODULE_LOADING": "DEFAULT"}).context == est.context
    assert estimate_outside(H100, [], {"CUDA_MODULE_LOADING": "EAGER"}).context > est.context + 500 * MiB


def test_one_rank_holds_nothing():
    est = estimate_outside(H100, [Communicator(1, 1, 1), Communicator(1, 1, 1)], {})
    assert est.per_communicator == [0, 0] and est.nccl == 0
    assert est.lines[1] == "NCCL: no communicator of more than one rank: nothing"
    assert estimate_outside(H100, [], {}).nccl == 0


def test_eight_h100s_on_one_node():
    # 32 rings of 12 MiB pairs (10 MiB receiving, 2 MiB sending, as NCCL logs them), the tree
    # as much again, NVLS 16 channels x 2 x 1 MiB x 8 heads + 2 MiB of credits
    assert nccl(H100, NODE8) == 32 * 12 * MiB * 2 + 258 * MiB
    assert nccl(H100, Communicator(2, 2, 1)) == 32 * 12 * MiB + 66 * MiB  # no tree beyond the ring
    assert nccl(H100, NODE8, {"NCCL_NVLS_ENABLE": "0"}) == 32 * 12 * MiB * 2
    assert nccl(H100, NODE8, {"NCCL_ALGO": "ring"}) == 32 * 12 * MiB


def test_monotone_in_size_and_channels():
    sizes = [nccl(H100, Communicator(n, n, 1)) for n in (1, 2, 3, 4, 8)]
    assert sizes == sorted(sizes) and sizes[0] == 0 < sizes[1]
    multi = [nccl(H100, Communicator(8 * n, 8, n)) for n in (2, 4, 8)]
    assert multi == sorted(multi)
    channels = [nccl(L4, NODE8, {"NCCL_MIN_NCHANNELS": str(n)}) for n in (0, 4, 8, 16)]
    assert channels == sorted(channels) and len(set(channels)) == 4
    assert nccl(H100, NODE8, {"NCCL_MAX_NCHANNELS": "8"}) < nccl(H100, NODE8)
    assert nccl(H100, NODE8, {"NCCL_MAX_CTAS": "8", "NCCL_MAX_NCHANNELS": "16"}) == nccl(
        H100, NODE8, {"NCCL_MAX_CTAS": "8"}
    )


def test_buffsize_scales_the_simple_part():
    off = {"NCCL_NVLS_ENABLE": "0"}
    by = {b: nccl(H100, NODE8, {**off, "NCCL_BUFFSIZE": str(b * MiB)}) for b in (4, 8, 16)}
    assert by[4] == nccl(H100, NODE8, off)
    pairs = 2 * 32  # ring and tree, 32 channels
    assert by[8] - by[4] == pairs * 4 * MiB and by[16] - by[8] == 2 * (by[8] - by[4])
    # on A100 NVLink the sender holds Simple (P2P read): the same total
    assert nccl(A100, NODE8, {"NCCL_BUFFSIZE": str(8 * MiB)}) - nccl(A100, NODE8) == 2 * 24 * 4 * MiB
    assert nccl(H100, NODE8, {**off, "NCCL_BUFFSIZE": "0x800000"}) == by[8]


def test_nvls_only_with_nvswitch_hopper_and_local_peers():
    with_nvls = estimate_outside(H100, [NODE8], {})
    assert "NVLS 258.00 MiB" in with_nvls.lines[1]
    without = estimate_outside(H100, [NODE8], {"NCCL_NVLS_ENABLE": "0"})
    assert "NVLS" not in without.lines[1] and with_nvls.nccl - without.nccl == 258 * MiB
    assert "NVLS" not in estimate_outside(L4, [NODE8], {}).lines[1]  # PCIe
    assert "NVLS" not in estimate_outside(A100, [NODE8], {}).lines[1]  # NVSwitch, but 8.0
    assert "NVLS" not in estimate_outside(H100, [Communicator(4, 1, 4)], {}).lines[1]  # one GPU a node
    assert "NVLS" in estimate_outside(H100, [Communicator(16, 8, 2)], {}).lines[1]  # NVLS tree
    assert "NVLS" not in estimate_outside(H100, [Communicator(16, 8, 2)], {"NCCL_ALGO": "^nvlstree"}).lines[1]
    chunk = nccl(H100, NODE8, {"NCCL_NVLS_CHUNKSIZE": str(256 << 10)}) - nccl(H100, NODE8)
    assert chunk == 256 * MiB
    assert nccl(H100, NODE8, {"NCCL_NVLS_NCHANNELS": "8"}) == nccl(H100, NODE8) - 128 * MiB


def test_communicators_across_nodes():
    # 16 channels across nodes; each node has one crossing per channel: ceil(16 / 8) = 2 of this
    # rank's, GPUDirect pairs of 10 MiB each way, the other 14 within the node
    ring = 14 * 12 * MiB + 2 * 20 * MiB
    assert nccl(H100, Communicator(16, 8, 2), {"NCCL_NVLS_ENABLE": "0"}) == 2 * ring
    no_gdr = nccl(H100, Communicator(16, 8, 2), {"NCCL_NVLS_ENABLE": "0", "NCCL_NET_GDR_LEVEL": "LOC"})
    assert no_gdr == 2 * 14 * 12 * MiB
    no_read = nccl(H100, Communicator(16, 8, 2), {"NCCL_NVLS_ENABLE": "0", "NCCL_NET_GDR_READ": "0"})
    assert no_gdr < no_read < 2 * ring
    # one rank a node: every channel crosses; a PCIe card is assumed on sockets: host memory only
    assert nccl(H100, Communicator(4, 1, 4)) == 2 * 16 * 20 * MiB
    est = estimate_outside(L4, [Communicator(4, 1, 4)], {})
    assert est.nccl == 0 and "all in host memory" in est.lines[1]
    assert nccl(L4, Communicator(4, 1, 4), {"NCCL_NET_GDR_LEVEL": "SYS"}) > 0


def test_send_recv_peers():
    # all-to-all on 8 H100s: 7 peers x 32 channels x 12 MiB, the 2.6 GiB of nccl#1685
    assert nccl(H100, NODE8, peers=7) - nccl(H100, NODE8) == 7 * 32 * 12 * MiB
    assert nccl(L4, NODE8, peers=1) - nccl(L4, NODE8) == 2 * 12 * MiB
    capped = nccl(H100, NODE8, {"NCCL_MAX_P2P_NCHANNELS": "4"}, peers=1) - nccl(H100, NODE8)
    assert capped == 4 * 12 * MiB
    # across nodes: four channels a local peer, one shared pool each way for the remote ones
    multi = Communicator(16, 8, 2)
    pool = 2 * 16 * 16 * 128 * 1024
    assert nccl(H100, multi, peers=15) - nccl(H100, multi) == 7 * 4 * 12 * MiB + pool
    assert "send/recv" in estimate_outside(H100, [NODE8], {}, p2p_peers=[2]).lines[1]
    with pytest.raises(ValueError):
        estimate_outside(H100, [NODE8], {}, p2p_peers=[8])
    with pytest.raises(ValueError):
        estimate_outside(H100, [NODE8], {}, p2p_peers=[1, 1])


@pytest.mark.parametrize(
    "name,value",
    [
        ("NCCL_BUFFSIZE", "abc"),
        ("NCCL_BUFFSIZE", "0"),
        ("NCCL_LL128_BUFFSIZE", "-1"),
        ("NCCL_MAX_NCHANNELS", "0"),
        ("NCCL_MIN_NCHANNELS", "1.5"),
        ("NCCL_NVLS_ENABLE", "3"),
        ("NCCL_NET_GDR_READ", "yes"),
        ("NCCL_NET_GDR_LEVEL", "NEAR"),
        ("NCCL_ALGO", "ring,fast"),
        ("NCCL_P2P_NET_CHUNKSIZE", "big"),
        ("CUDA_MODULE_LOADING", "SOMETIMES"),
    ],
)
def test_bad_environment_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        estimate_outside(H100, [NODE8], {name: value})


def test_bad_communicators():
    for bad in (Communicator(8, 9, 1), Communicator(8, 4, 1), Communicator(8, 8, 2), Communicator(0, 0, 1)):
        with pytest.raises(ValueError):
            estimate_outside(H100, [bad], {})


def test_nccl_algo_forms():
    full = nccl(H100, NODE8)
    assert nccl(H100, NODE8, {"NCCL_ALGO": "allreduce:^tree"}) == full  # other functions keep all
    assert nccl(H100, NODE8, {"NCCL_ALGO": "ring;allreduce:tree"}) == full - 258 * MiB
    assert nccl(H100, NODE8, {"NCCL_ALGO": "^Tree,NVLS"}) == 32 * 12 * MiB
    assert nccl(H100, NODE8, {"NCCL_ALGO": ""}) == full


def test_lines_name_what_they_count():
    est = estimate_outside(H100, [NODE8, NODE8, Communicator(16, 8, 2), Communicator(1, 1, 1)], {})
    context, comms = est.lines
    assert context.startswith("CUDA context: about 520.00 MiB")
    assert "compute capability 9.0" in context and "lazy module loading" in context
    assert comms.startswith("NCCL: 4 communicators (2 x 8 ranks on 1 node, 16 ranks on 2 nodes, 1 rank on 1 node)")
    for what in ("ring", "tree", "NVLS", "NCCL_BUFFSIZE", "4.00 MiB Simple", "512.00 KiB LL", "4.69 MiB LL128"):
        assert what in comms
    assert "send/recv" not in comms
    assert "16.00 MiB Simple" in estimate_outside(H100, [NODE8], {"NCCL_BUFFSIZE": str(16 * MiB)}).lines[1]
    assert "eager module loading" in estimate_outside(H100, [], {"CUDA_MODULE_LOADING": "EAGER"}).lines[0]
    assert "compute capability 7.5" in estimate_outside(gpu_model("T4"), [], {}).lines[0]
