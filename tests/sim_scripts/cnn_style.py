"""A torchvision-style image classification loop: a CPU data loader, pinned batches, SGD."""

import argparse

import torch
import torch.nn as nn


def make_model(width):
    def block(cin, cout):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        )

    return nn.Sequential(
        block(3, width),
        block(width, width),
        nn.MaxPool2d(2),
        block(width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 10),
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--width", type=int, default=32)
    a = p.parse_args()
    device = "cuda"
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * a.batch_size, 3, 64, 64), torch.randint(0, 10, (4 * a.batch_size,))
    )
    loader = torch.utils.data.DataLoader(data, batch_size=a.batch_size, shuffle=True, pin_memory=True, num_workers=2)
    model = make_model(a.width).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    crit = nn.CrossEntropyLoss()
    for epoch in range(a.epochs):
        correct = 0
        for images, target in loader:
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            out = model(images)
            loss = crit(out, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += (out.argmax(1) == target).sum().item()
        print(f"epoch {epoch} acc {correct / len(data):.3f}")


if __name__ == "__main__":
    main()
