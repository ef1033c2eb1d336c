"""The lab: allocation traces, how they are made, and what a pool does with them, on a CPU.

- :mod:`cudapool.lab.trace`: the trace format (``.cptrace``), loading, writing and merging.
- :mod:`cudapool.fakegpu` (a package of its own, not the lab's) makes traces: a PyTorch program
  on fake CUDA tensors, without a GPU (:mod:`cudapool.fakegpu.tracer`). The lab imports none of it.
- :mod:`cudapool.lab.torch_snapshot`: traces from ``torch.cuda.memory._snapshot()`` pickles.
- :mod:`cudapool.lab.replay`: a trace through the real C pool on a simulated device;
  :mod:`cudapool.lab.replay_report` says its result for people, :mod:`cudapool.lab.capacity`
  finds the smallest device, :mod:`cudapool.lab.peak_snapshot` a snapshot at the peak.
- :mod:`cudapool.lab.device_costs`: what the device calls of a replay cost on a GPU.
- :mod:`cudapool.lab.plot`: memory over time, from a snapshot.

Importing the lab imports neither torch nor any of these modules; each is imported on its own.
"""
