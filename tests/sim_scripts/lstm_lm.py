"""A word-level LSTM language model trainer in the shape of the well-known examples: a corpus
tokenised on the host, batchified into columns, truncated backpropagation through time with
the hidden state detached between chunks, gradient clipping, a plain SGD update by hand, and
the whole model saved."""

import argparse
import math

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--emsize", type=int, default=400)
p.add_argument("--nhid", type=int, default=800)
p.add_argument("--nlayers", type=int, default=2)
p.add_argument("--bptt", type=int, default=35)
p.add_argument("--batch-size", type=int, default=20)
p.add_argument("--chunks", type=int, default=4)
p.add_argument("--vocab", type=int, default=10000)
p.add_argument("--save", default="lstm.pt")
args = p.parse_args()

device = torch.device("cuda")
words = [f"w{(i * 31337) % args.vocab}" for i in range(args.batch_size * args.bptt * (args.chunks + 1) + 1)]
vocab = {w: i for i, w in enumerate(sorted(set(words)))}
ids = torch.tensor([vocab[w] for w in words], dtype=torch.long)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous().to(device)


train = batchify(ids, args.batch_size)


class RNNModel(nn.Module):
    def __init__(self, ntoken):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(ntoken, args.emsize)
        self.rnn = nn.LSTM(args.emsize, args.nhid, args.nlayers, dropout=0.2)
        self.decoder = nn.Linear(args.nhid, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)

    def forward(self, x, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(output)).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(args.nlayers, bsz, args.nhid), weight.new_zeros(args.nlayers, bsz, args.nhid))


model = RNNModel(len(vocab)).to(device)
criterion = nn.NLLLoss()
model.train()
hidden = model.init_hidden(args.batch_size)
lr = 20.0
for batch, i in enumerate(range(0, train.size(0) - 1, args.bptt)):
    seq_len = min(args.bptt, len(train) - 1 - i)
    data, targets = train[i : i + seq_len], train[i + 1 : i + 1 + seq_len].view(-1)
    model.zero_grad()
    hidden = tuple(h.detach() for h in hidden)
    output, hidden = model(data, hidden)
    loss = criterion(torch.log_softmax(output, dim=-1), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for prm in model.parameters():
        prm.data.add_(prm.grad, alpha=-lr)
    print(f"batch {batch} | loss {loss.item():5.2f} | ppl {math.exp(loss.item()):8.2f}")
with open(args.save, "wb") as f:
    torch.save(model, f)
print("saved", args.save)
