"""Helper for test_safe_checkpoints.py: save tag `a` on one rank, then save it again and SIGKILL itself mid-save.

    python tests/support/save_then_die.py --dir D --kill-at N --reference R [--port P]

Trains the toy model 2 steps, saves `a` into D and writes what that checkpoint must restore to R; trains one more step
and saves `a` again, killing this process with SIGKILL just before the Nth call that changes D (fault_injection.watch
counts them). Exits 0 only if the kill never came.
"""

import argparse
import os
import signal
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--kill-at", type=int, required=True, help="SIGKILL before the save's Nth call changing --dir")
    parser.add_argument("--reference", required=True, help="where to write the first checkpoint's engine state")
    parser.add_argument("--port", default="29531", help="MASTER_PORT of the one-rank group")
    args = parser.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port)

    import deepspeed
    import torch
    from support.fault_injection import engine_state, watch
    from support.toy import MIN_8BIT_SIZE, build_engine, train_steps

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE)
    train_steps(engine, range(2))
    engine.save_checkpoint(args.dir, tag="a")
    torch.save(engine_state(engine), args.reference)
    train_steps(engine, range(2, 3))
    with watch(args.dir, fail_at=args.kill_at, on_fault=lambda step: os.kill(os.getpid(), signal.SIGKILL)):
        engine.save_checkpoint(args.dir, tag="a")


if __name__ == "__main__":
    main()
