"""One process of test_several_gpus's launch (torchrun, two processes): the gradients of a 2-layer
halstm.nn.LSTM inside DistributedDataParallel for this rank's share of the batch, saved for the test.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_ranks.py CASE OUT [--compile]

CASE is the file the test saved: the state_dict, the whole batch x and the loss weights dy, dh.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist

import halstm.nn

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")  # NVLink multicast off


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("case")
    p.add_argument("out")
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP-wrapped model")
    args = p.parse_args()
    case = torch.load(args.case)
    cuda = case["device"] == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = halstm.nn.LSTM(*case["sizes"], num_layers=2).to(device)
    model.load_state_dict(case["state_dict"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    run = torch.compile(ddp, backend="inductor" if cuda else "aot_eager") if args.compile else ddp
    share = slice(rank * case["x"].shape[1] // world, (rank + 1) * case["x"].shape[1] // world)
    x, dy, dh = case["x"][:, share].to(device), case["dy"][:, share].to(device), case["dh"][share].to(device)
    y, (h, _) = run(x)
    ((y * dy).mean() + (h * dh).mean()).backward()  # each rank's mean: DDP's average is the batch's mean
    torch.save({n: p.grad.cpu() for n, p in model.named_parameters()}, os.path.join(args.out, f"rank{rank}.pt"))
    # DDP's reducer holds the process group: dropped first, the group and its gloo threads go with
    # destroy_process_group. Left to the interpreter's exit, a gloo thread could free its last work,
    # which holds a Python object, after finalisation began: "terminate called without an active
    # exception" (a rank aborted in about 3 of 8 launches on a loaded 2-core CPU, none of 20 since).
    del run, ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
