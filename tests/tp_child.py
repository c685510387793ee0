"""A rank of test_tensor_parallel's all-reduce test. A spawned process imports the module its
target lives in: this one needs only torch, where the test module imports transformers."""

import torch

from worker.tensor_parallel import all_reduce, init_process_group, use_shared_memory


def sum_through_shared_memory(rank, path, results):
    torch.set_num_threads(1)
    init_process_group(rank, 2, path, torch.device("cpu"))
    assert use_shared_memory(1000)
    gen = torch.Generator().manual_seed(rank)
    sums = []
    for n in [1, 7, 576, 1000] * 50 + [1001]:  # (1001: past the slots, through gloo)
        x = torch.randn(n, generator=gen)
        mine = x.clone()
        all_reduce(x)
        sums.append((mine.numpy(), x.numpy()))
    results.put((rank, sums))
    results.close()
    results.join_thread()  # (before exiting: the parent must get the whole message)
