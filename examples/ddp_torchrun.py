"""Multi-process DDP training, written the way pytorch/examples writes it
(``distributed/ddp-tutorial-series/multigpu_torchrun.py``), ported to CPU.

The only resilient-specific lines are ``import resilient`` and the backend name::

    resilient-run --standalone --nproc-per-node 4 examples/ddp_torchrun.py 3 1
    torchrun      --standalone --nproc-per-node 4 examples/ddp_torchrun.py 3 1 --backend gloo

Under ``resilient-run`` a worker that dies mid-training (SIGKILL, OOM) does not stop the
others: they finish the epochs without it, every step's gradient is the exact mean over
the workers whose gradients were summed (no comm hook needed: docs/ddp.md) and the job
exits 0. With ``--max-restarts N`` a dead worker is started again; since this script keeps
no ``resilient.elastic.State``, the restarted worker is not admitted (it could not be
synced at a step boundary) and exits 0 saying so. ``examples/train.py`` shows the
``State`` version, whose restarted workers rejoin.
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import resilient  # noqa: F401 - registers the "resilient" torch.distributed backend


class MyTrainDataset(Dataset):
    def __init__(self, size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.size = size
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup(backend):
    init_process_group(backend=backend)


class Trainer:
    def __init__(self, model, train_data, optimizer):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.train_data = train_data
        self.optimizer = optimizer
        self.model = DDP(model)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}", flush=True)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            loss = self._run_batch(source, targets)
        print(f"[RANK{self.global_rank}] Epoch {epoch} | loss {loss:.5f}", flush=True)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def load_train_objs(dataset_size, lr):
    train_set = MyTrainDataset(dataset_size)  # load your dataset
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))


def main(total_epochs, batch_size, dataset_size, lr, backend):
    ddp_setup(backend)
    dataset, model, optimizer = load_train_objs(dataset_size, lr)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="Accepted for compatibility with the tutorial (no snapshots)")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--dataset_size", default=2048, type=int, help="Samples in the synthetic dataset")
    parser.add_argument("--lr", default=1e-2, type=float, help="SGD learning rate")
    parser.add_argument("--backend", default="resilient", help="torch.distributed backend (resilient, gloo)")
    args = parser.parse_args()
    main(args.total_epochs, args.batch_size, args.dataset_size, args.lr, args.backend)
