"""tools/benchmark.py's measurements as one suite: the settings and spread of each figure, its JSON
line, the final table, and the memory table's torchrun jobs (one per world size, model, strategy).
Run through ``tools/benchmark.py``; ``benchmarks.loop`` times training and evaluation,
``benchmarks.loading`` the data pipelines."""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile

from yacs.config import CfgNode

from benchmarks.loading import measure_data, measure_decode, measure_packed
from benchmarks.loop import (
    build_bench_run,
    measure_breakdown,
    measure_eval,
    measure_memory,
    measure_training,
    measure_variants,
)
from benchmarks.report import Report, bench_cfg, synthetic_cfg
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import (
    cleanup_distributed,
    setup_distributed,
)

# ------------------------------------------------------------------------------------------------
# Table and entry point
# ------------------------------------------------------------------------------------------------
WHAT = ("train", "plain", "breakdown", "data", "decode", "eval", "variants", "memory", "packed", "index")
DEFAULT_WHAT = "train,plain,breakdown,data,decode,eval"


def _breakdown_line(r: dict) -> str:
    """A breakdown record's line: where a training step's time goes (and a teacher's forward, if any)."""
    teacher = f"  teacher ({r['teacher_arch']}) fwd {r['teacher_ms']:.1f} ms" if r.get("teacher_ms") is not None else ""
    return (
        f"breakdown {r['arch']:<20} np={r['world_size']}  data {r['data_ms']:.2f} ms  fwd+bwd "
        f"{r['fwd_bwd_ms']:.1f} ms  all-reduce (exposed) {r['allreduce_exposed_ms']:.1f} ms  optimizer "
        f"{r['optimizer_ms']:.1f} ms  lr+metrics {r['bookkeeping_ms']:.2f} ms" + teacher
    )


def format_table(records: list[dict]) -> str:
    """A human-readable summary of the JSON records."""
    lines = []
    for r in records:
        w = r.get("what")
        if w in ("train", "variant"):
            lines.append(
                f"{w:<9} {r['impl']:<9} {r['arch']:<20} np={r['world_size']} bs={r['batch_per_proc']:<4} "
                f"{r['precision']:<4} cl={int(r['channels_last'])} thr={r['threads_per_proc']}  "
                f"{r['images_per_s_median']:9.1f} img/s (min {r['images_per_s_min']:.1f}, max "
                f"{r['images_per_s_max']:.1f})  {r['ms_per_step_median']:8.1f} ms/step"
                + (f"  peak {r['peak_mem_mib']:.0f} MiB ({r['peak_mem_kind']})" if "peak_mem_mib" in r else "")
                + (f"  warm-up {r['warmup_steps']} steps {r['warmup_s']:.1f} s" if r.get("warmup_s") else "")
            )
        elif w == "ratio":
            lines.append(
                f"ratio     framework/plain {r['arch']:<10} np={r['world_size']}  {r['framework_over_plain']:.3f} "
                f"(paired: median {r['paired_ratio_median']:.3f}, min {r['paired_ratio_min']:.3f}, "
                f"max {r['paired_ratio_max']:.3f})"
            )
        elif w == "breakdown":
            lines.append(_breakdown_line(r))
        elif w in ("data", "decode_pipeline"):
            lines.append(
                f"{w:<15} {r['decoder']:<18} workers={r['workers']} np={r['world_size']} im={r['im_size']}  "
                f"{r['images_per_s']:9.1f} img/s ({r['images_per_s_per_proc']:.1f} per process)"
            )
        elif w == "packed_pipeline":
            lines.append(
                f"packed    {r['path']:<26} workers={r['workers']} im=224  {r['images_per_s_per_proc']:8.1f} img/s "
                f"({r['images_per_s_per_core']:.1f} per core; min {r['images_per_s_min']:.1f}, max "
                f"{r['images_per_s_max']:.1f}; {r['over_folder_pil_paired_median']:.2f}x folder+pil, paired)"
            )
        elif w == "worker_side":
            lines.append(
                f"worker_side {r['decoder']:<18} batch {r['batch_per_proc']}  {r['images_per_s_per_worker']:9.1f} img/s "
                f"per worker (min {r['images_per_s_min']:.1f}, max {r['images_per_s_max']:.1f})"
            )
        elif w == "decode":
            lines.append(
                f"decode    {r['decoder']:<11} {r['image']} on {r['device']}, batch {r['batch']}  "
                f"{r['images_per_s_per_proc']:9.1f} img/s (1 process; min {r['images_per_s_min']:.1f}, "
                f"max {r['images_per_s_max']:.1f})"
            )
        elif w == "memory":
            mib = {k: r[f"{k}_bytes"] / 2**20 for k in ("params", "grads", "optimizer", "state")}
            lines.append(
                f"memory    {r['strategy']:<10} {r['arch']:<20} np={r['world_size']}  params {mib['params']:.1f} + grads "
                f"{mib['grads']:.1f} + optimizer {mib['optimizer']:.1f} = {mib['state']:.1f} MiB per rank  peak "
                f"{r['peak_mem_mib']:.0f} MiB ({r['peak_mem_kind']})  {r['images_per_s_median']:.1f} img/s"
            )
        elif w == "eval":
            lines.append(
                f"eval      {r['arch']:<20} np={r['world_size']} bs={r['batch_per_proc']}  "
                f"{r['images_per_s_median']:9.1f} img/s (min {r['images_per_s_min']:.1f}, max {r['images_per_s_max']:.1f})"
            )
    return "\n".join(lines)


def benchmark(bench: argparse.Namespace, cfg_args: argparse.Namespace) -> list[dict]:
    """Run the requested measurements; return the records (rank 0 has printed them)."""
    first = bench_cfg(cfg_args)  # a bad config fails here, before the process group starts
    env = setup_distributed(first.DIST.BACKEND, first.DIST.TIMEOUT_S)
    try:
        return measure(bench, cfg_args, first, env)
    finally:
        # After measure has returned: the runs it built (their DDP or FSDP models hold the process
        # group) went with its frame, so the group ends here, not during interpreter shutdown.
        cleanup_distributed()


def measure(bench: argparse.Namespace, cfg_args: argparse.Namespace, first: CfgNode, env: DistEnv) -> list[dict]:
    """The measurements ``bench.what`` names, in the process group ``env`` describes; their records."""
    report = Report(env, bench.json)
    what = set(bench.what)
    if what & {"train", "plain"}:  # the configured dataset, as train_net.py reads it
        measure_training(build_bench_run(first, env), bench, report, "train" in what, "plain" in what)
    run = None
    if what & {"breakdown", "eval"}:
        run = build_bench_run(synthetic_cfg(cfg_args, env, bench.steps), env)
    if "breakdown" in what:
        measure_breakdown(run, env, bench, report)
    if "eval" in what:
        measure_eval(run, env, bench, report)
    if "memory" in what:
        measure_memory(run or build_bench_run(synthetic_cfg(cfg_args, env, bench.steps), env), env, bench, report)
    if "variants" in what:
        measure_variants(cfg_args, env, bench, report)
    if "data" in what:
        measure_data(cfg_args, env, bench, report)
    if "decode" in what:
        measure_decode(cfg_args, env, bench, report)
    if "packed" in what:
        measure_packed(cfg_args, env, bench, report)
    if "index" in what and env.is_main_process:  # starts its own ranks: benchmarks/index.py
        from benchmarks import index

        found = index.measure(report.emit, bench.index_folder, bench.index_entries, bench.index_ranks, bench.repeats)
        print("\n" + index.table(found), flush=True)
    if env.is_main_process:
        print("\n" + format_table(report.records), flush=True)
    return report.records


TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "benchmark.py")
STRATEGY_OPTS = {"ddp": [], "ddp+zero1": ["OPTIM.ZERO", "True"], "fsdp": ["DIST.STRATEGY", "fsdp"]}


def memory_table(bench: argparse.Namespace, cfg_args: argparse.Namespace) -> str:
    """Run --what memory for every world size x arch x strategy (one torchrun job each); a markdown table."""
    own = ["--steps", str(bench.steps), "--warmup", str(bench.warmup), "--repeats", str(bench.repeats)]
    own += [*(["--cfg", cfg_args.cfg_file] if cfg_args.cfg_file else []), *cfg_args.opts]
    rows = []
    for arch in bench.archs.split(","):
        name, *kwargs = arch.split(":")  # "vit_tiny_patch16_224:img_size=32:patch_size=4": MODEL.KWARGS
        arch_opts = ["MODEL.ARCH", name, *(["MODEL.KWARGS", repr(kwargs)] if kwargs else [])]
        for world in bench.memory_table:
            results = {}
            for strategy, opts in STRATEGY_OPTS.items():
                with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
                    _torchrun(
                        world,
                        [TOOL, "--what", "memory", "--json", out.name, *own, *arch_opts, *opts],
                    )
                    results[strategy] = json.loads(out.read().splitlines()[-1])
            for strategy, r in results.items():
                ratio = r["images_per_s_median"] / results["ddp"]["images_per_s_median"]
                rows.append((name, world, strategy, r, ratio))
    mib = 2**20
    lines = [
        "| model | ranks | strategy | params | grads | optimizer | sum per rank | vs ddp | peak RSS per rank | img/s | vs ddp |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arch, world, name, r, ratio in rows:
        ddp_bytes = next(x[3]["state_bytes"] for x in rows if x[:2] == (arch, world) and x[2] == "ddp")
        lines.append(
            f"| {arch} | {world} | {name} | {r['params_bytes'] / mib:.1f} MiB | {r['grads_bytes'] / mib:.1f} MiB "
            f"| {r['optimizer_bytes'] / mib:.1f} MiB | {r['state_bytes'] / mib:.1f} MiB | {r['state_bytes'] / ddp_bytes:.2f} "
            f"| {r['peak_mem_mib']:.0f} MiB | {r['images_per_s_median']:.1f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def _torchrun(world: int, script_args: list[str]) -> None:
    """``torchrun --nproc_per_node=world script_args`` with torchrun's agent in this process (as
    Accelerate launches it): one interpreter's start-up less a job. The workers' stdout goes to a
    temporary log folder (the table is this process's output); OMP_NUM_THREADS defaults to 1."""
    from torch.distributed import run as torchrun

    from distribuuuu.runtime.launcher import find_free_port

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    added_threads = "OMP_NUM_THREADS" not in os.environ
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with tempfile.TemporaryDirectory(prefix="benchmark-memory-") as logs:
            torchrun.run(
                torchrun.parse_args(
                    [f"--nproc_per_node={world}", "--master_addr=127.0.0.1", f"--master_port={find_free_port()}",
                     "--redirects=1", f"--log-dir={logs}", *script_args]
                )
            )  # fmt: skip
    finally:
        if added_threads:
            del os.environ["OMP_NUM_THREADS"]
        for sig, handler in saved.items():  # the agent installs its own
            signal.signal(sig, handler)
