"""An RL loop with a live vLLM engine refitted through rdma-plan after every training step.

    bash scripts/setup.sh --test                          # once: makes the live venv
    scripts/live-python examples/rl_loop/run.py --steps 3

1. writes the tiny model folder vLLM serves (`model/config.json` and a word-level tokenizer
   built locally: no download), and compiles the plan (`fsdp2.yaml`);
2. starts `vllm serve` on it: TP 2, fp32, dummy weights, `--weight-transfer-config
   '{"backend": "rdma_plan"}'` (the backend comes in through vLLM's `vllm.general_plugins`
   entry point), `VLLM_SERVER_DEV_MODE=1` for the RL routes (pause, resume, weight sync,
   weight checker);
3. runs the trainer ranks under torchrun (`train.py`), which refit the engine after every
   step and check it; exits non-zero when any check failed.

`--shadow`: the zero-pause refit (the engine keeps serving while the weights land; paused
only around the switch). `--throttle-ms X [--throttle-steps 2,4]`: a slow source (the
trainer ranks start their writes X ms late). `--stall-step K --timeout-s T`: a torn transfer
at step K (trainer rank 1 stalls past the plan's timeout T; shadow: version K-1 must keep
serving; paused: the engine stays paused and the trainer sends step K again). `--compare`:
the paused refit, then the shadow one, on one engine.

Output: this script's and the trainer's own lines (docs/rl-loop.md explains each field); the
engine's log goes to `vllm-serve.log` in the work folder (named at start; `--verbose` prints
it here instead, and vLLM's and NIXL's log lines in the trainer ranks). The work folder is a
temporary one unless `--workdir` is given, removed at the end of a run that passed and kept
(and named) after one that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(folder: str) -> None:
    """config.json and a word-level tokenizer of `vocab_size` tokens `t0 t1 ...`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copy(os.path.join(HERE, "model", "config.json"), folder)
    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
                   "bos_token": "t1", "eos_token": "t2", "model_max_length": 512}, f)


QUIET = {"VLLM_LOGGING_LEVEL": "ERROR", "NIXL_LOG_LEVEL": "WARN", "PYTHONWARNINGS": "ignore",
         "TORCH_CPP_LOG_LEVEL": "ERROR"}
"""The trainer ranks' environment without `--verbose`: vLLM's and torch's errors only, NIXL's
warnings and errors, no Python warnings (Megatron's fallbacks, torch's deprecations)."""


def compile_plan(config: str, plan: str, key: str, who: str) -> None:
    """`rdma-plan compile CONFIG -o PLAN --sign-key KEY`, summed up in one line (its own
    output only when it fails)."""
    r = subprocess.run([sys.executable, "-m", "planner", "compile", config, "-o", plan,
                        "--sign-key", key], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(f"{who}: rdma-plan compile {config} failed (exit {r.returncode})")
    stats = dict(kv.split("=", 1) for kv in r.stdout.split(": ", 1)[-1].split())
    what = (f"{stats['writes']} writes" if "writes" in stats else
            f"{stats['chunks']} chunks of {stats['chunked_budget']} bytes")
    print(f"{who}: compiled {os.path.relpath(config, REPO)} -> {plan} ({what}, "
          f"{stats['bytes']} bytes, signed)", flush=True)


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float, log: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if server.poll() is not None:
            raise SystemExit(f"run.py: vllm serve exited with code {server.returncode} before "
                             f"it was up; its log: {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"run.py: vllm serve was not up within {timeout_s:g} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=["fsdp2", "megatron"], default="fsdp2")
    ap.add_argument("--steps", type=int, default=3, help="training steps (K)")
    ap.add_argument("--workdir", help="where the model folder and plan go (default: a temp dir)")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--shadow", action="store_true",
                    help="zero-pause refit: the engine serves during the transfer, paused "
                         "only around the switch (train.py --shadow)")
    ap.add_argument("--compare", action="store_true",
                    help="the paused refit, then the shadow one, on the same engine")
    ap.add_argument("--throttle-ms", type=float, default=0.0,
                    help="a slow source: every trainer rank starts its writes this late")
    ap.add_argument("--throttle-steps", default="", help="the steps it applies to (e.g. 2,4)")
    ap.add_argument("--stall-step", type=int, default=-1,
                    help="a torn transfer at this step: trainer rank 1 stalls past the timeout")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="the plan's peer timeout")
    ap.add_argument("--verbose", action="store_true",
                    help="the engine's log and vLLM's INFO lines here, not in a file")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="rl-loop-")
    code = 1
    try:
        code = run(args, work)
    finally:
        if args.workdir is None and code == 0:
            shutil.rmtree(work, ignore_errors=True)
        elif args.workdir is None:
            print(f"run.py: kept the work folder {work} (the engine's log, the plan)",
                  flush=True)
    return code


def run(args: argparse.Namespace, work: str) -> int:
    model = os.path.join(work, "model")
    os.makedirs(model, exist_ok=True)
    write_model(model)
    config = os.path.join(HERE, f"{args.variant}.yaml")
    plan = os.path.join(work, f"{args.variant}.rplan")
    key = os.path.join(work, "plan.key")  # the plan is signed; every loader checks it
    with open(key, "wb") as f:
        f.write(secrets.token_bytes(32))
    compile_plan(config, plan, key, "run.py")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the job secret every plan rank authenticates its control messages with (drawn once per
    # job; trainer ranks and vLLM workers inherit it)
    os.environ.setdefault("RDMA_PLAN_SECRET", secrets.token_hex(32))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the server
    env = dict(os.environ, PYTHONPATH=REPO, VLLM_SERVER_DEV_MODE="1", VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
    # = `vllm serve MODEL ...`; vllm-cpu 0.32.0's `vllm` script fails at start (it asks
    # importlib.metadata for a distribution named "vllm"), so its module is run instead
    log_path = os.path.join(work, "vllm-serve.log")
    log = None if args.verbose else open(log_path, "w")
    if log is not None:
        print(f"run.py: starting vllm serve (TP 2); its log: {log_path} (--verbose shows it "
              "here)", flush=True)
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--port", str(port), "--tensor-parallel-size", "2",
         "--dtype", "float32", "--load-format", "dummy", "--max-model-len", "256",
         "--max-num-seqs", "4", "--enforce-eager",  # no torch.compile warm-up: minutes on CPU
         "--weight-transfer-config", '{"backend": "rdma_plan"}'],
        env=env, cwd=REPO, start_new_session=True,  # this checkout's rdma-plan
        stdout=log, stderr=subprocess.STDOUT if log is not None else None)
    # the trainer ranks' library lines (vLLM's platform notes, NIXL's agent lines) only with
    # --verbose: by default the console holds this script's and the trainer's own lines
    quiet = {} if args.verbose else QUIET
    try:
        t0 = time.monotonic()
        wait_healthy(url, server, args.startup_timeout, log_path if log else "above")
        print(f"run.py: vllm serve up in {time.monotonic() - t0:.0f} s at {url}", flush=True)
        modes = ["paused", "shadow"] if args.compare else ["shadow" if args.shadow else "paused"]
        code = 0
        for mode in modes:  # one engine: each trainer run releases its connection at the end
            print(f"run.py: {mode} refit", flush=True)
            shadow = mode == "shadow"
            trainer = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(free_port()), os.path.join(HERE, "train.py"),
                 "--variant", args.variant, "--plan", plan, "--plan-key", key,
                 "--config", config, "--model", model, "--url", url,
                 "--steps", str(args.steps),
                 "--throttle-ms", str(args.throttle_ms), "--throttle-steps", args.throttle_steps,
                 "--stall-step", str(args.stall_step),
                 "--timeout-s", str(args.timeout_s)] + ["--shadow"] * shadow,
                env=dict(os.environ, PYTHONPATH=REPO, VLLM_TARGET_DEVICE="cpu",
                         OMP_NUM_THREADS="1", **quiet), cwd=REPO)
            code = code or trainer.returncode
        return code
    finally:
        stop(server)
        if log is not None:
            log.close()


def stop(server: subprocess.Popen) -> None:
    """Stop the server as Ctrl-C does: SIGINT to the API server alone, which shuts its engine
    core and workers down in order (a signal to the whole group at once kills the engine
    core under the API server, which then logs `EngineDeadError`); the group is killed only
    if it is not down within 60 s."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
