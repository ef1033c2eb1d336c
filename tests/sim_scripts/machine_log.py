"""What training scripts do around the model: log the machine with nvidia-smi, keep a copy of the
initial state with copy.deepcopy, and step two optimizers per iteration."""

import copy
import subprocess

import torch
import torch.nn as nn

print(subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, text=True, check=True).stdout, end="")
query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
print(subprocess.run(query, stdout=subprocess.PIPE, text=True, check=True).stdout, end="")
model = nn.Sequential(nn.Embedding(1000, 256), nn.Linear(256, 1000)).cuda()
initial = copy.deepcopy(model.state_dict())  # 2 x 256,000 floats + the bias
embed = torch.optim.Adam(model[0].parameters())
head = torch.optim.SGD(model[1].parameters(), lr=0.1)
for step in range(10):
    print("iteration", step)
    model(torch.randint(0, 1000, (8, 16), device="cuda")).float().sum().backward()
    embed.step()
    head.step()
    model.zero_grad(set_to_none=True)
