"""Every workload race on an accelerator, at its large size, in one command.

On a lent GPU (the ``device`` tool, 15 minutes of device time in all) one
prepared command must race every workload: each at its large size (the
workload's ``--large``: batch and model grown until the best Adam's step
takes 4-9 ms on an H200, so that the device, not the host, sets the pace),
K-FAC (the README's recipe and the workload's tuned settings) against Adam
and Muon at their grids of learning rates, ``--budget-s`` seconds of step
time each. Schedule-Free AdamW, PSGD Kron, Shampoo and the contenders
paired with kfac-jax are left out to fit the time; the CPU races have them. Each workload runs in
its own process (a crash or an out-of-memory ends that workload only) and
writes its ``<name>_large_gpu`` JSON, plot and RESULTS.md section as its
script does. Then, if time is left, the step profile of the large
transformer LM (``studies/step_profile.py --large``, XLA's CUDA graphs off so
that the profile names every op). A workload that would start after
``--deadline-s`` is skipped, one still running then is stopped, and the
summary says so.

From the repository root, on the GPU machine::

  python benchmarks/accelerator.py              # races 7.6-8.7 min on an H200 (2026-11-27, 28, 29)
  python benchmarks/accelerator.py --quick      # the quick sizes, on any backend

The image workloads read Fashion-MNIST from Debian's package, which a bare
GPU machine lacks: copy its four files into a folder git ignores here and
carry it, then put them back there before the races, e.g.
``mkdir -p /usr/share/datasets/fashion-mnist && cp .gpudata/*.gz
/usr/share/datasets/fashion-mnist/`` (without them the workloads fall back to
scikit-learn's 8x8 digits, a different race).
"""

import argparse
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = ("transformer_lm", "autoencoder", "convnet", "resnet")
RACE_FLAGS = ["--no-matched", "--no-adaptive", "--kfac-jax", "skip",
              "--schedule-free-lrs", "none", "--psgd-kron-lrs", "none",
              "--shampoo-lrs", "none", "--log-every", "0"]
# JAX 0.11.2's XLA aborted compiling ResNet's K-FAC step on an H200 in its
# Triton GEMM fusion pass ("triton_tiling_propagation.cc:703 Check failed:
# subdim_size_accumulator == dim_size"); without Triton GEMMs it compiles.
XLA_FLAGS = {"resnet": "--xla_gpu_enable_triton_gemm=false"}
PROFILE_MIN_S = 115  # the step profile took 111 s on an H200, compiles included


def with_xla_flags(flags):
  """The environment with ``flags`` added to XLA_FLAGS."""
  return {**os.environ, "XLA_FLAGS": " ".join(filter(None, [
      os.environ.get("XLA_FLAGS"), flags]))}


def run(name, command, timeout, env=None):
  """Runs ``command`` (its output passed through); ``(status, seconds)``."""
  started = time.perf_counter()
  print(f"=== {name}: {' '.join(command)}", flush=True)
  try:
    code = subprocess.run(command, cwd=REPO_ROOT, timeout=timeout, check=False,
                          env=env).returncode
    status = "ok" if code == 0 else f"exit code {code}"
  except subprocess.TimeoutExpired:
    status = f"stopped at the deadline ({timeout:.0f} s)"
  return status, time.perf_counter() - started


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--budget-s", type=float, default=4.0,
                      help="seconds of step time per contender")
  parser.add_argument("--deadline-s", type=float, default=575.0,
                      help="no workload starts or runs on after this many seconds")
  parser.add_argument("--quick", action="store_true",
                      help="the workloads' quick sizes (writes nothing)")
  parser.add_argument("--workloads", default=",".join(WORKLOADS))
  args = parser.parse_args(argv)
  started, summary = time.perf_counter(), []
  for workload in args.workloads.split(","):
    left = args.deadline_s - (time.perf_counter() - started)
    if left <= 0:
      summary.append((workload, "skipped: past the deadline", 0.0))
      continue
    size = ["--quick"] if args.quick else ["--large", "--budget-s", str(args.budget_s)]
    status, seconds = run(workload, [sys.executable, f"benchmarks/{workload}.py",
                                     *size, *RACE_FLAGS], left,
                          with_xla_flags(XLA_FLAGS.get(workload)))
    summary.append((workload, status, seconds))
  left = args.deadline_s - (time.perf_counter() - started)
  if args.quick:
    summary.append(("step profile", "not run with --quick", 0.0))
  elif left < PROFILE_MIN_S:
    summary.append(("step profile", f"skipped: {left:.0f} s left", 0.0))
  else:
    summary.append(("step profile", *run("step profile", [
        sys.executable, "benchmarks/studies/step_profile.py", "--large",
        "--workload", "transformer_lm", "--steps", "10", "--profile-steps", "3"],
        left, with_xla_flags("--xla_gpu_enable_command_buffer="))))
  print("\n| workload | status | seconds |\n|---|---|---:|")
  for workload, status, seconds in summary:
    print(f"| {workload} | {status} | {seconds:.0f} |")
  return summary


if __name__ == "__main__":
  main()
