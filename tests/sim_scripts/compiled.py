"""torch.compile on the model: traced as compiled on the native engine, eagerly on the Python one."""

import torch
import torch.nn as nn

model = torch.compile(nn.Linear(64, 64).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
