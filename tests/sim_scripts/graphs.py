"""CUDA graphs by hand: a capture with torch.cuda.graph, replays, and make_graphed_callables."""

import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
static_x = torch.randn(64, 256, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side), torch.no_grad():
    for _ in range(2):  # warm-up on a side stream, as torch's docs do
        model(static_x)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.no_grad(), torch.cuda.graph(graph):
    static_y = model(static_x)
print("captured", torch.cuda.memory_allocated())
for _ in range(5):
    static_x.copy_(torch.randn(64, 256, device="cuda"))
    graph.replay()
print("replayed", torch.cuda.memory_allocated())
layer = nn.Linear(256, 256).cuda()
graphed = torch.cuda.make_graphed_callables(layer, (torch.randn(32, 256, device="cuda", requires_grad=True),))
graphed(torch.randn(32, 256, device="cuda", requires_grad=True)).sum().backward()
