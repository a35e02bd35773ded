# PyTorch's side of bench_ddp_mlp (bench/ddp_mlp.cpp) on the CPU or a GPU: ../shared/bench/ddp_mlp.py
# (which stays the CPU baseline of bench/compare.sh) with --device and --synthetic added.
# The same MLP (784 -> hidden x layers -> 10, Linear+ReLU), SGD lr 0.05 momentum 0.9, per-rank
# batch, sampling and seeds, so both sides print the same loss.
# usage (torchrun's env: MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK, or torchrun itself):
#   python bench/ddp_mlp_peer.py --hidden 1024 --layers 2 --batch 128 --steps 200
#          [--device cpu|cuda] [--synthetic] [--ddp]
# --device cuda: cuda:LOCAL_RANK (cuda:0 when one GPU is visible), DDP over NCCL; cpu: Gloo.
# DDP wraps the model when WORLD_SIZE > 1, or with --ddp at world 1 too (a world-1 process group),
# so that world 1 measures DDP's own overhead as replica's side (always DDP) does.
# --synthetic: random inputs [60000, 784] in [0,1) and labels in [0,10) from a fixed seed
# instead of Fashion-MNIST (the GPU machines have no dataset package).
# Rank 0 prints: peer=pytorch-ddp world=.. params=.. batch/rank=.. steps/s=.. samples/s=.. loss=.. device=..
import argparse, gzip, os, sys, time, torch, torch.distributed as dist
from torch import nn
p = argparse.ArgumentParser()
p.add_argument('--hidden', type=int, default=1024); p.add_argument('--layers', type=int, default=2)
p.add_argument('--batch', type=int, default=128); p.add_argument('--steps', type=int, default=200)
p.add_argument('--warmup', type=int, default=20); p.add_argument('--threads', type=int, default=1)
p.add_argument('--device', choices=['cpu', 'cuda'], default='cpu')
p.add_argument('--synthetic', action='store_true')
p.add_argument('--ddp', action='store_true', help='DDP (and a process group) at world 1 too')
a = p.parse_args()
torch.set_num_threads(a.threads)
world = int(os.environ.get('WORLD_SIZE', '1'))
if a.device == 'cuda':
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit(f"ddp_mlp_peer: --device cuda asked for, but no GPU is visible "
                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    local_rank = int(os.environ.get('LOCAL_RANK', '0'))
    index = 0 if gpus == 1 else local_rank
    if index >= gpus:
        sys.exit(f'ddp_mlp_peer: LOCAL_RANK {local_rank} has no GPU of its own ({gpus} visible)')
    torch.cuda.set_device(index)
    dev = torch.device('cuda', index)
else:
    dev = torch.device('cpu')
distributed = world > 1 or a.ddp
if distributed:
    # device_id binds the NCCL communicator to this rank's GPU (and its barrier to that GPU).
    if dev.type == 'cuda': dist.init_process_group('nccl', device_id=dev)
    else: dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
else:
    rank = 0
if a.synthetic:
    # Made on the CPU from its own generator, as bench_ddp_mlp does: the same numbers on every device.
    gd = torch.Generator().manual_seed(2)
    X = torch.rand(60000, 784, generator=gd); Y = torch.randint(0, 10, (60000,), generator=gd)
else:
    # As the shared script reads it, through torch alone (the GPU machines' Python may lack numpy).
    D = '/usr/share/datasets/fashion-mnist/'
    with gzip.open(D + 'train-images-idx3-ubyte.gz') as f: X = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8, offset=16)
    with gzip.open(D + 'train-labels-idx1-ubyte.gz') as f: Y = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8, offset=8)
    X = X.reshape(-1, 784).to(torch.float32) / 255.0; Y = Y.to(torch.long)
X, Y = X.to(dev), Y.to(dev)
torch.manual_seed(0)
dims = [784] + [a.hidden] * a.layers
mods = []
for i in range(a.layers): mods += [nn.Linear(dims[i], dims[i + 1]), nn.ReLU()]
model = nn.Sequential(*mods, nn.Linear(dims[-1], 10)).to(dev)
if distributed:
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == 'cuda' else None)
else:
    ddp = model
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
lossf = nn.CrossEntropyLoss()
n = X.shape[0]
# On a GPU the indices are drawn there (as bench_ddp_mlp does), so no step waits for a copy.
g = torch.Generator(device=dev).manual_seed(1)
def step(i):
    idx = torch.randint(0, n, (a.batch * world,), generator=g, device=dev)[rank * a.batch:(rank + 1) * a.batch]
    opt.zero_grad(set_to_none=True)
    loss = lossf(ddp(X[idx]), Y[idx]); loss.backward(); opt.step(); return loss
def settle():
    # Every rank's steps finished, on the device too, before the clock is read.
    if dev.type == 'cuda': torch.cuda.synchronize()
    if distributed: dist.barrier()
    if dev.type == 'cuda': torch.cuda.synchronize()
for i in range(a.warmup): step(i)
settle()
t = time.perf_counter()
for i in range(a.steps): l = step(i)
settle()
dt = time.perf_counter() - t
if rank == 0:
    nparam = sum(p.numel() for p in model.parameters())
    print(f'peer=pytorch-ddp world={world} params={nparam} batch/rank={a.batch} steps/s={a.steps/dt:.2f} '
          f'samples/s={a.steps*a.batch*world/dt:.1f} loss={l.item():.4f} device={dev}')
if distributed: dist.destroy_process_group()
