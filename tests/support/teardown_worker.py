"""Helper for test_teardown.py: a gloo rank that writes its result and ends in a chosen way.

    torchrun --nproc_per_node 2 tests/support/teardown_worker.py OUT MODE

Every rank writes OUT/result<rank>, then ends with teardown.finish(), except as MODE says:
- clean: as is;
- abort_after: rank 1's final exit is a SIGABRT instead (what gloo's C++ teardown does to a finished rank);
- abort_before: rank 1 dies of SIGABRT before writing its result;
- error_after: rank 1's final exit is exit code 3 instead (a failure that is not the teardown abort);
- deepspeed: the group is DeepSpeed's (its CPU comm op creates a shared-memory buffer per rank) and one all-reduce
  runs before the end;
- deepspeed_without_release: as deepspeed, but each rank leaves the group and exits as DeepSpeed's own code would,
  without teardown's release of that buffer (the control that shows DeepSpeed leaves it behind).
"""

import os
import sys

import torch.distributed as tdist

from deepspeed_bnb.utils import teardown


def main():
    out, mode = sys.argv[1:]
    if mode.startswith("deepspeed"):
        import deepspeed
        import torch
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        deepspeed.comm.all_reduce(torch.ones(4))
    else:
        tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    if mode == "abort_before" and rank == 1:
        os.abort()
    with open(os.path.join(out, f"result{rank}"), "w") as f:
        f.write(mode)
    if rank == 1 and mode in ("abort_after", "error_after"):
        # finish() still marks the rank done, meets the others and destroys the group; only its last act changes
        exit_now = os._exit
        os._exit = (lambda code: os.abort()) if mode == "abort_after" else (lambda code: exit_now(3))
    if mode == "deepspeed_without_release":
        tdist.barrier()
        tdist.destroy_process_group()
        os._exit(0)
    teardown.finish()


if __name__ == "__main__":
    main()
