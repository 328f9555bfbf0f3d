"""The `deepspeed-bnb run` checks, each a fresh process or launch (run as one background job of
tests/distributed/test_run_wrapper.py): writes OUT/checks.json, case -> what it showed.

- plain / wrapped Python: whether deepspeed_bnb is loaded before and after `import deepspeed` (the plain process is
  the control: nothing changes for a process that did not ask), and whether a wrapped process that never imports
  DeepSpeed loads deepspeed_bnb or torch at all;
- another sitecustomize on PYTHONPATH still runs under the wrapper;
- a command that is not found, none at all; an untested DeepSpeed release, refused by the wrapper before the command
  starts and, in a process the wrapper's check did not see, at `import deepspeed`;
- tests/support/run_wrapper_rank.py on 2 ranks under torchrun, the deepspeed launcher and accelerate launch, wrapped,
  and under torchrun without the wrapper (the control): which ZeRO optimizer each rank's engines got.

    python tests/support/run_wrapper_checks.py OUT
"""

import json
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
BIN = os.path.dirname(sys.executable)
RANK_SCRIPT = os.path.join(TESTS, "support", "run_wrapper_rank.py")
WRAPPER = [sys.executable, "-m", "deepspeed_bnb_tools", "run", "--"]  # the `deepspeed-bnb` entry point's module
# (transformers and Accelerate ask for DeepSpeed's spec before they import it: so does the probe)
PROBE = ("import importlib.util, sys; importlib.util.find_spec('deepspeed'); before = 'deepspeed_bnb' in sys.modules; "
         "import deepspeed; "
         "print('PROBE', before, 'deepspeed_bnb' in sys.modules, sys.modules['deepspeed_bnb'].installer.is_active() "
         "if 'deepspeed_bnb' in sys.modules else None)")
NO_DEEPSPEED = "import sys, json; print('PROBE', 'deepspeed_bnb' in sys.modules, 'torch' in sys.modules)"
THE_SENTENCE = "deepspeed-bnb run: deepspeed_bnb is active but leaves this engine to DeepSpeed"
ROUTED = ("deepspeed-bnb run: deepspeed_bnb's BnbZeroOptimizer steps bitsandbytes.optim.adamw.AdamW8bit's state under "
          "ZeRO stage 2")


def free_port() -> int:
    from deepspeed_bnb.utils.teardown import unused_port  # (imports deepspeed_bnb: not at this script's start)
    return unused_port()


def environment(**extra) -> dict:
    """The job's environment (the suite starts it without rank variables) without the wrapper's marker or the
    untested-release override, with the checkout on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DEEPSPEED_BNB_RUN", "DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p]))
    env.update(extra)
    return env


def run(cmd, env=None, timeout=600) -> dict:
    done = subprocess.run(cmd, env=env or environment(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    probes = [line.split()[1:] for line in output.splitlines() if line.startswith("PROBE")]
    return {"rc": done.returncode, "probes": probes, "tail": output[-3000:],
            "sentence": output.count(THE_SENTENCE)}


def launch(name, cmd, out) -> dict:
    """A 2-rank launch of the rank script writing into out/name; its result plus every rank's file."""
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    from deepspeed_bnb.utils.teardown import run_ranks  # a launch that only failed by gloo's teardown abort passes
    done = run_ranks(cmd + [RANK_SCRIPT, folder], 2, env=environment(), timeout=600, cwd=ROOT)
    ranks = []
    for rank in range(2):
        path = os.path.join(folder, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    return {"ok": done.ok, "ranks": ranks, "sentence": done.output.count(THE_SENTENCE),
            "routed": done.output.count(ROUTED),
            "tail": done.output[-3000:]}


def main():
    out = sys.argv[1]
    checks = {"plain": run([sys.executable, "-c", PROBE]),
              "wrapped": run(WRAPPER + [sys.executable, "-c", PROBE]),
              "wrapped_no_deepspeed": run(WRAPPER + [sys.executable, "-c", NO_DEEPSPEED]),
              "not_found": run(WRAPPER + ["no-such-command-here"]),
              "no_command": run([sys.executable, "-m", "deepspeed_bnb_tools", "run"])}
    other = os.path.join(out, "other_site")  # an environment's own sitecustomize
    os.makedirs(other, exist_ok=True)
    with open(os.path.join(other, "sitecustomize.py"), "w") as f:
        f.write("import os; print('PROBE other-sitecustomize-ran', os.environ.get('DEEPSPEED_BNB_RUN', '-'))\n")
    checks["chained"] = run(WRAPPER + [sys.executable, "-c", PROBE], environment(PYTHONPATH=other + os.pathsep + ROOT))
    checks["chained_plain"] = run([sys.executable, "-c", "pass"], environment(PYTHONPATH=other + os.pathsep + ROOT))
    # a rank whose DeepSpeed reads as a release deepspeed_bnb was not tested with (package metadata found first on
    # its path): deepspeed_bnb cannot activate there. Started with the wrapper's environment directly, as a launcher
    # on another node (another environment) would start it: the wrapper's own up-front check saw this node's.
    untested = os.path.join(out, "untested", "deepspeed-0.15.0.dist-info")
    os.makedirs(untested, exist_ok=True)
    with open(os.path.join(untested, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.15.0\n")
    from deepspeed_bnb.launch.wrapper import environment as wrapped_environment
    checks["cannot_activate"] = run(
        [sys.executable, "-c", "import deepspeed; print('PROBE trained-anyway')"],
        wrapped_environment(environment(PYTHONPATH=os.path.dirname(untested) + os.pathsep + ROOT)))
    checks["untested_up_front"] = run(WRAPPER + [sys.executable, "-c", "print('PROBE started')"],
                                      environment(PYTHONPATH=os.path.dirname(untested) + os.pathsep + ROOT))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    checks["torchrun"] = launch("torchrun", WRAPPER + torchrun, out)
    checks["torchrun_plain"] = launch("torchrun_plain", torchrun[:-1] + [f"--master_port={free_port()}"], out)
    checks["deepspeed_launcher"] = launch("deepspeed_launcher", WRAPPER + [
        os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())], out)
    checks["accelerate"] = launch("accelerate", WRAPPER + [
        os.path.join(BIN, "accelerate"), "launch", "--config_file", os.path.join(ROOT, "configs",
                                                                                  "accelerate_zero2.yaml"),
        "--num_processes", "2", "--main_process_port", str(free_port())], out)
    with open(os.path.join(out, "checks.json"), "w") as f:
        json.dump(checks, f, indent=1)


if __name__ == "__main__":
    main()
