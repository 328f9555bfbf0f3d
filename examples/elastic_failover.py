"""Lose a node, keep training at the smaller size, grow back, lose nothing: examples/train.py under torchrun's elastic
agent, with two agents on the loopback address standing for two nodes.

    python examples/elastic_failover.py [--steps 60] [--kill-at 15] [--regrow-at 35] [--nproc 1]

1. An uninterrupted reference run (`torchrun --standalone`, 2 x nproc ranks) of the same command.
2. The elastic run: agent A (which hosts the c10d rendezvous store, as the first node of a job does) and agent B, each
   `torchrun --nnodes 1:2 --nproc-per-node nproc --rdzv-backend c10d --max-restarts K`. Every change of size is tied
   to a training step, not to the clock: the workers hold at a step boundary (train.py --hold_at) and the next move
   waits for that event. After step --kill-at (at the larger size), agent B and its workers are SIGKILLed (a node
   gone); A's workers fail on the lost peers, A restarts them at the smaller world size, and they load the latest
   complete checkpoint (`--resume auto`). After step --regrow-at (a checkpoint step, at the smaller size) a new agent
   B starts; A sees a node waiting, restarts its workers, and the job re-forms at the larger size from the latest
   checkpoint. The kill thus loses exactly --kill-at modulo --save-every steps and the grow none, however fast the
   machine runs.
3. A control: the first checkpoint after the kill resumed with fresh optimizer state (weights and step only).
4. The noise floor: the same run, uninterrupted, at the other world size. A different world size sums gradients in
   another order; with 8-bit state a last-bit difference can move a value to the neighbouring code, so runs at
   different sizes drift apart slightly even without any failure; the elastic run is judged against that.
Prints the timeline (holds, kill, restarts, resumed step, world size, lost steps, seconds from kill to the first step
at the new size) and how far the elastic run's losses, held-out losses and final weights are from the reference's.
Processes are started and ended here, by PID, on 127.0.0.1 only. The runs' workers end with teardown.finish(), and a
`torchrun --standalone` run counts as finished when it failed only by gloo's teardown abort after every rank was
done (see deepspeed_bnb/utils/teardown.py).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List

from deepspeed_bnb.utils.teardown import run_ranks, unused_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def train_args(args, save_dir: str, events: str, extra=()) -> List[str]:
    return [os.path.join(HERE, "train.py"), "--deepspeed_config", os.path.join(ROOT, args.config),
            "--width", str(args.width), "--depth", str(args.depth), "--steps", str(args.steps),
            "--global_batch", str(args.global_batch), "--save_every", str(args.save_every), "--keep", "100",
            "--save_dir", save_dir, "--events", events, *extra]


def torchrun() -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def standalone(args, world: int, train: List[str], log: str) -> None:
    """An uninterrupted `torchrun --standalone` run of train.py on `world` ranks, its output in workdir/<log>.log."""
    launch = run_ranks([*torchrun(), "--standalone", f"--nproc-per-node={world}", *train], world, env=clean_env(),
                       timeout=args.timeout, log_path=os.path.join(args.workdir, f"{log}.log"))
    if not launch.ok:
        raise RuntimeError(launch.failure())


def read_events(path: str) -> List[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def wait_for(path: str, condition, timeout: float, what: str, procs=()) -> List[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        events = read_events(path)
        if condition(events):
            return events
        for proc in procs:
            if proc.poll() is not None and proc.returncode != 0:
                raise RuntimeError(f"{what}: a launcher exited with {proc.returncode} first (see its log)")
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s; last events: {read_events(path)[-3:]}")


def kill_node(proc: subprocess.Popen) -> List[int]:
    """SIGKILL an agent and every process under it (its workers run in sessions of their own): a node gone."""
    import psutil
    victims = [proc.pid]
    try:
        victims += [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    return victims


def held(step: int, world: int):
    """Condition for wait_for: the workers hold after `step` at `world` ranks (train.py --hold_at)."""
    return lambda events: any(e["event"] == "hold" and (e["step"], e["world"]) == (step, world) for e in events)


def check_plan(args) -> None:
    """Each size is reached once, at a known step. --regrow-at is a checkpoint step: the grown job resumes there
    (past --kill-at, whose hold it must not meet again), and a round that forms before the new node has joined
    resumes there too and holds before training anything. A checkpoint precedes --kill-at, so the smaller job
    resumes past step 0."""
    if not 0 < args.kill_at < args.regrow_at < args.steps:
        raise ValueError(f"need 0 < --kill-at ({args.kill_at}) < --regrow-at ({args.regrow_at}) < --steps "
                         f"({args.steps})")
    if args.save_every <= 0 or args.regrow_at % args.save_every or args.kill_at < args.save_every:
        raise ValueError(f"need --regrow-at ({args.regrow_at}) a multiple of --save-every ({args.save_every}) and "
                         f"--kill-at ({args.kill_at}) at least --save-every")


def steps_by_number(events: List[dict]) -> Dict[int, dict]:
    """The last record of each step (a step redone after a restart replaces the lost one)."""
    return {e["step"]: e for e in events if e["event"] == "step"}


def prepare_workdir(args) -> None:
    """An empty workdir: a second run would resume from the first run's checkpoints (the elastic job would start at
    the last step and end at once, and the wait for its next step would time out), so a used one is refused, or
    cleared with --fresh."""
    used = sorted(os.listdir(args.workdir)) if os.path.isdir(args.workdir) else []
    if used and not args.fresh:
        raise ValueError(f"--workdir {args.workdir} already holds a run ({', '.join(used[:5])}"
                         f"{' ...' if len(used) > 5 else ''}): its checkpoints would be resumed instead of trained "
                         f"anew. Pass --fresh to delete it first, or another --workdir.")
    if used:
        print(f"--fresh: deleting the previous run in {args.workdir}", flush=True)
        shutil.rmtree(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)


def run(args) -> dict:
    check_plan(args)
    prepare_workdir(args)
    logs = lambda name: open(os.path.join(args.workdir, f"{name}.log"), "w")  # noqa: E731
    world = 2 * args.nproc

    # 1. the reference: uninterrupted, at the larger size
    ref_events = os.path.join(args.workdir, "reference.jsonl")
    began = time.time()
    standalone(args, args.reference_world or world, train_args(args, os.path.join(args.workdir, "reference"),
                                                               ref_events), "reference")
    reference_seconds = time.time() - began
    noise = None
    if not args.no_noise_run:  # the same run, uninterrupted, at the other world size: what changing it alone does
        other = args.nproc if (args.reference_world or world) != args.nproc else world
        noise_events = os.path.join(args.workdir, "other_size.jsonl")
        standalone(args, other, train_args(args, os.path.join(args.workdir, "other_size"), noise_events), "other_size")
        noise = (other, steps_by_number(read_events(noise_events)))

    # 2. the elastic run
    port, events = unused_port(), os.path.join(args.workdir, "elastic.jsonl")
    save_dir = os.path.join(args.workdir, "elastic")
    # The holds (train.py --hold_at) tie every change of size to a step. 0@nproc: a first round that formed before
    # the second agent joined (rendezvous' last call is a timeout) waits at step 0, untrained, for the full one.
    holds = [f"0@{args.nproc}", f"{args.kill_at}@{world}", f"{args.regrow_at}@{args.nproc}"]

    def agent(hosts_store: bool) -> List[str]:
        # which agent hosts the rendezvous store is said, not left to whichever binds the port first: the store must
        # outlive agent B
        return [*torchrun(), "--nnodes=1:2", f"--nproc-per-node={args.nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=failover", f"--max-restarts={args.max_restarts}",
                "--monitor-interval=0.5",
                "--rdzv-conf=join_timeout=120,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,"
                f"heartbeat_timeout=3,is_host={str(hosts_store).lower()}",
                *train_args(args, save_dir, events, ["--resume", "auto", "--min_step_seconds",
                                                     str(args.min_step_seconds),
                                                     *[flag for spec in holds for flag in ("--hold_at", spec)]])]
    timeline = []

    def mark(what, **fields):
        timeline.append({"t": time.time(), "what": what, **fields})

    # torch shares the rendezvous TCPStore with the workers by default, and then publishes the workers' MASTER_ADDR
    # only in the first round of an agent (DynamicRendezvousHandler caches it): a node joining later waits for it
    # forever ("wait timeout ... MASTER_ADDR") and the job cannot grow back. Without the sharing every round
    # publishes its own.
    agent_env = {**clean_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    a = subprocess.Popen(agent(True), env=agent_env, stdout=logs("agent_a"), stderr=subprocess.STDOUT)
    mark("start agent A")
    b = subprocess.Popen(agent(False), env=agent_env, stdout=logs("agent_b"), stderr=subprocess.STDOUT)
    mark("start agent B")
    try:
        # every worker stands between steps (the last checkpoint complete) while the node goes
        wait_for(events, held(args.kill_at, world), args.timeout, f"the hold after step {args.kill_at} at world "
                 f"{world}", (a, b))
        killed = kill_node(b)
        kill_time = time.time()
        step_at_kill = max(steps_by_number(read_events(events)))
        mark("SIGKILL agent B and its workers", pids=killed, step=step_at_kill)
        # ...and while the new node joins: the smaller job cannot run ahead, or to its end, before the job re-forms
        wait_for(events, held(args.regrow_at, args.nproc), args.timeout, f"the hold after step {args.regrow_at} at "
                 f"world {args.nproc}", (a,))
        b = subprocess.Popen(agent(False), env=agent_env, stdout=logs("agent_b2"), stderr=subprocess.STDOUT)
        grow_time = time.time()
        mark("start agent B again", step=max(steps_by_number(read_events(events))))
        wait_for(events, lambda ev: any(e["event"] == "done" for e in ev), args.timeout, "the end", (a, b))
        for proc in (a, b):
            proc.wait(timeout=args.timeout)
        if a.returncode or b.returncode:
            raise RuntimeError(f"agents exited with {a.returncode}, {b.returncode}")
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                kill_node(proc)

    # 3. the control: the first checkpoint after the kill, resumed with fresh optimizer state
    all_events = read_events(events)
    starts = [e for e in all_events if e["event"] == "start"]
    resumed_after_kill = next(e for e in starts if e["t"] > kill_time)
    control_events = os.path.join(args.workdir, "control.jsonl")
    control_dir = os.path.join(args.workdir, "control")
    control = control_run(args, save_dir, resumed_after_kill["step"], control_dir, control_events,
                          args.reference_world or world)

    reference = steps_by_number(read_events(ref_events))
    elastic = steps_by_number(all_events)
    loss_diff = max(abs(elastic[s]["loss"] - reference[s]["loss"]) for s in reference)
    control_diff = max(abs(control[s]["loss"] - reference[s]["loss"]) for s in control)
    first_after = lambda t, w: min(e["t"] for e in all_events if e["event"] == "step" and e["t"] > t  # noqa: E731
                                   and e["world"] == w)
    grow_start = next(e for e in starts if e["t"] > grow_time)
    summary = {
        "steps": args.steps, "world_sizes": [e["world"] for e in starts],
        "start_steps": [e["step"] for e in starts],
        "lost_on_kill": step_at_kill - resumed_after_kill["step"],
        "lost_on_grow": max(e["step"] for e in all_events if e["event"] == "step" and e["t"] < grow_start["t"])
        - grow_start["step"],
        "kill_to_first_step_s": round(first_after(kill_time, args.nproc) - kill_time, 2),
        "grow_to_first_step_s": round(first_after(grow_time, world) - grow_time, 2),
        "max_loss_diff": loss_diff, "control_max_loss_diff": control_diff,
        "held_out_diff": max(abs(e["valid"] - r["valid"]) for e in all_events if e["event"] == "save"
                             for r in read_events(ref_events) if r["event"] == "save" and r["step"] == e["step"]),
        "held_out_by_checkpoint": [
            (e["step"], e["world"], round(e["valid"], 6),
             round(next(r["valid"] for r in read_events(ref_events) if r["event"] == "save" and r["step"] == e["step"]),
                   6)) for e in all_events if e["event"] == "save"],
        "final_weights_max_diff": weights_diff(os.path.join(args.workdir, "reference"), save_dir),
        "control_final_weights_max_diff": weights_diff(os.path.join(args.workdir, "reference"), control_dir),
        "reference_seconds": round(reference_seconds, 1),
        **({"other_size_world": noise[0],
            "other_size_max_loss_diff": max(abs(noise[1][s]["loss"] - reference[s]["loss"]) for s in reference),
            "other_size_final_weights_max_diff": weights_diff(os.path.join(args.workdir, "reference"),
                                                              os.path.join(args.workdir, "other_size"))}
           if noise else {}),
        "timeline": [{**m, "t": round(m["t"] - timeline[0]["t"], 2)} for m in timeline]
        + [{"t": round(e["t"] - timeline[0]["t"], 2), "what": "workers started", "world": e["world"],
            "resumed_step": e["step"]} for e in starts]
        + [{"t": round(e["t"] - timeline[0]["t"], 2), "what": "workers hold", "world": e["world"], "step": e["step"]}
           for e in all_events if e["event"] == "hold"],
    }
    summary["timeline"].sort(key=lambda m: m["t"])
    return summary


def control_run(args, save_dir, step, control_dir, control_events, world) -> Dict[int, dict]:
    """Resume the elastic run's checkpoint of `step` with fresh optimizer state, to the end."""
    import shutil
    os.makedirs(control_dir, exist_ok=True)
    tag = f"global_step{step}"
    shutil.copytree(os.path.join(save_dir, tag), os.path.join(control_dir, tag))
    with open(os.path.join(control_dir, "latest"), "w") as f:
        f.write(tag)
    standalone(args, world, train_args(args, control_dir, control_events, ["--resume", control_dir,
                                                                       "--resume_weights_only"]), "control")
    return {s: e for s, e in steps_by_number(read_events(control_events)).items() if s > step}


def weights_diff(reference_dir: str, other_dir: str) -> float:
    """Largest |difference| between the final fp32 master weights of two checkpoints (read offline)."""
    from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
    a, b = SavedCheckpoint(reference_dir), SavedCheckpoint(other_dir)
    worst = 0.0
    for g in range(len(a.groups)):
        for x, y in zip(a.master_weights(g), b.master_weights(g)):
            worst = max(worst, float((x - y).detach().abs().max()))
    return worst


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="checkpoints/failover", help="where the runs write (must be empty or new)")
    p.add_argument("--fresh", action="store_true", help="delete what a previous run left in --workdir first")
    p.add_argument("--config", default="configs/zero2_adamw8bit.json")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=15)
    p.add_argument("--regrow-at", type=int, default=35)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--nproc", type=int, default=1, help="ranks per agent (node)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--min-step-seconds", type=float, default=0, help="pace the elastic run (to watch it; the "
                                                                        "failures are tied to steps regardless)")
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--no-noise-run", action="store_true", help="skip the uninterrupted run at the other world size "
                                                                "(which shows how far changing the size alone moves "
                                                                "the numbers: reduction order)")
    p.add_argument("--reference-world", type=int, default=0, help="ranks of the reference and control runs (default: "
                                                                    "2 x nproc; the data order does not depend on it)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="also write the summary (timeline and distances) to this file, as JSON")
    return p


def main():
    args = parser().parse_args()
    summary = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"\n{'t (s)':>7}  event")
    for m in summary.pop("timeline"):
        detail = ", ".join(f"{k}={v}" for k, v in m.items() if k not in ("t", "what"))
        print(f"{m['t']:>7.1f}  {m['what']}" + (f" ({detail})" if detail else ""))
    print("\nheld-out loss at each checkpoint (step, world size, this run, uninterrupted run):")
    for step, world, valid, reference in summary.pop("held_out_by_checkpoint"):
        print(f"  step {step:>4}  world {world}  {valid:.6f}  {reference:.6f}")
    print()
    for key, value in summary.items():
        print(f"{key:>30}: {value}")


if __name__ == "__main__":
    main()
