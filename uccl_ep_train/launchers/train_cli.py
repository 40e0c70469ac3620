"""`uccl-ep-train train [overrides...] [--dry-run] [--config-dir DIR]`: compose a recipe, validate it, and run it
locally (torchrun) or on Slurm (sbatch), or print what would run."""
from __future__ import annotations

import argparse
import sys

from uccl_ep_train.launchers.recipes import GROUPS, RecipeError, available


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a recipe (Hydra overrides: model=deepseek_v3 cluster=p5en_efa dispatcher=uccl ...)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  uccl-ep-train train model=tiny_1gpu parallelism=ep2 dispatcher=uccl\n"
               "  uccl-ep-train train model=deepseek_v3 parallelism=dsv3_pp16_ep16 cluster=p5en_efa "
               "cluster.account=acct cluster.container.image=/fsx/uccl.sqsh --dry-run\n"
               "recipes: docs/recipes.md")
    p.add_argument("overrides", nargs="*", help="Hydra overrides: group=option or dotted.key=value")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved recipe and the exact command / sbatch script; start nothing")
    p.add_argument("--config-dir", help="a folder of extra recipe options (same layout: cluster/x.yaml, ...)")
    p.add_argument("--list", action="store_true", help="list the options of every recipe group and exit")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        return _train(args)
    except RecipeError as exc:
        print(f"uccl-ep-train train: {exc}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from uccl_ep_train.launchers import argv as argv_mod
    from uccl_ep_train.launchers import local, rundir, slurm
    from uccl_ep_train.launchers.recipes import compose
    from uccl_ep_train.launchers.validation import validate

    if args.list:
        for group in GROUPS:
            print(f"{group}: {', '.join(available(group, args.config_dir))}")
        return 0
    cfg = compose(args.overrides, args.config_dir)
    topo = validate(cfg)
    run_dir = rundir.resolve(cfg, topo)
    resume = bool(cfg.run.resume)
    rundir.check(run_dir, resume)
    inv = argv_mod.build(cfg, topo, run_dir, resume=resume)

    if cfg.cluster.launcher == "local":
        text = local.render(cfg, inv, topo)
    else:
        text = slurm.render(cfg, inv, topo, run_dir, args.overrides)

    if args.dry_run:
        print("# ---- resolved recipe ----")
        print(OmegaConf.to_yaml(cfg, resolve=True), end="")
        print(f"# ---- run directory (not created in a dry run): {run_dir} ----")
        print(f"# world size {topo.world_size} = TP {topo.tp} x PP {topo.pp} x CP {topo.cp} x DP {topo.dp}; "
              f"EP {topo.ep}, ETP {topo.etp}" + (f", VPP {topo.vpp}" if topo.vpp else ""))
        print("# ---- command ----" if cfg.cluster.launcher == "local" else "# ---- sbatch script ----")
        print(text, end="" if text.endswith("\n") else "\n")
        return 0

    command_text = text if cfg.cluster.launcher == "local" else f"sbatch {run_dir / 'job.sbatch'}"
    rundir.create(run_dir, cfg, resume, command_text, list(args.overrides))
    print(f"uccl-ep-train: run directory {run_dir}")
    if cfg.cluster.launcher == "local":
        print(f"uccl-ep-train: {text}")
        return local.run(cfg, inv, topo, run_dir)
    script = run_dir / ("job.resume.sbatch" if resume else "job.sbatch")
    script.write_text(text)
    job = slurm.submit(script)
    print(f"uccl-ep-train: submitted Slurm job {job}; log: {run_dir}/slurm-{job}.out")
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="uccl-ep-train")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["train", *sys.argv[1:]])
    sys.exit(ns.func(ns))
