"""The Examples section of every `usp <command> --help` page, kept beside each other so they read as
one short tour; usp.cli appends them to the commands' help when the app is built."""
from __future__ import annotations

EXAMPLES: dict[str, list[str]] = {
    "plan": ["usp plan                                          # the default tiny run",
             "usp plan conf=llama3_1_8b                         # a recipe",
             "usp plan model=llama3_1_70b cluster=slurm_h100 cluster.nodes=8 parallelism.tp=8",
             "usp plan --search model=llama3_1_8b cluster=slurm_h100 cluster.nodes=2",
             "usp plan --save conf=my_recipe.yaml               # also write runs/<name>/plan.yaml",
             "usp plan --build-check conf=llama3_1_405b 0 511   # build ranks 0 and 511 on meta, no GPU",
             "usp plan conf=mixtral_8x7b --html plan.html       # the plan as a page (charts, schedule, mesh)",
             "usp plan conf=llama3_1_70b --json                 # the plan as JSON (plan.yaml's fields)"],
    "ui": ["usp ui                                            # http://127.0.0.1:8765/",
           "usp ui --conf llama3_1_70b --port 0               # another recipe first, a free port",
           "usp ui --host 0.0.0.0 --token \"$(openssl rand -hex 16)\"   # reachable by others: a token"],
    "estimate": ["usp estimate conf=llama3_1_405b train.tokens=15.6e12 --gpus 16384",
                 "usp estimate conf=llama3_1_8b train.tokens=1e12 --hours 240",
                 "usp estimate conf=llama3_1_8b train.tokens=1e12 --scaling --max-nodes 64 --plot scaling.png"],
    "train": ["usp train conf=tiny_demo                         # the CPU demo",
              "usp train parallelism=fsdp cluster.procs_per_node=2 train.steps=50",
              "usp train optimizer=sgd optimizer.lr=0.1 optimizer.schedule=wsd",
              "usp train conf=llama3_1_8b cluster=slurm_h100 --dry-run   # write job.sbatch only"],
    "submit": ["usp submit conf=llama3_1_8b cluster.slurm.partition=gpu",
               "usp submit --dry-run conf=llama3_1_8b          # print the batch script"],
    "cancel": ["usp cancel runs/llama3_1_8b", "usp cancel                                        # the newest run"],
    "logs": ["usp logs runs/tiny_demo --tail 20", "usp logs runs/tiny_demo --rank 1 -f"],
    "status": ["usp status", "usp status runs/tiny_demo"],
    "checkpoints": ["usp checkpoints verify runs/tiny_demo"],
    "checkpoints verify": ["usp checkpoints verify runs/tiny_demo                # every checkpoint of the run",
                           "usp checkpoints verify runs/tiny_demo --step 300     # one of them"],
    "export": ["usp export runs/tiny_demo",
               "usp export runs/tiny_demo --step 100 --format safetensors --out models/tiny",
               "usp export runs/tiny_demo --format hf --out models/tiny_hf --force   # replace an older export",
               "usp export runs/big --format hf --shard-mb 1000   # files of at most 1000 MiB: the export's memory"],
    "verify": ["usp verify parallelism=fsdp cluster.procs_per_node=2",
               "usp verify parallelism.tp=2 cluster.procs_per_node=2 --steps 3"],
    "calibrate": ["usp calibrate runs/ --cluster local_cpu --out conf/cluster/my_cpu.yaml   # from my usp runs",
                  "usp calibrate measured.csv --cluster slurm_h100 --profile megatron --holdout 4",
                  "usp calibrate measured.csv --cluster slurm_h100 --fit network   # only the cluster's latencies"],
    "prepare-data": ["usp prepare-data", "usp prepare-data data=text_files data.paths='[\"~/corpus/*.txt\"]'"],
    "sweep": ["usp sweep train.micro_batch=4,8 parallelism.tp=1,2 cluster.procs_per_node=2",
              "usp sweep --dry-run --name lr optimizer.lr=1e-3,3e-3"],
    "report": ["usp report runs/tiny_demo", "usp report runs/sweep-20250101-120000 --out /tmp/report"],
    "config": ["usp config list", "usp config show model=llama3_1_8b", "usp config cp tiny_demo my_run.yaml"],
    "config list": ["usp config list"],
    "config show": ["usp config show model=llama3_1_8b", "usp config show tiny_demo"],
    "config cp": ["usp config cp tiny_demo my_run.yaml && usp train conf=my_run.yaml"],
}


def with_examples(name: str, text: str | None) -> str:
    """`text` and an Examples section; "\\b" keeps click from re-wrapping the example lines."""
    lines = "\n".join(f"  {line}" for line in EXAMPLES[name])
    return f"{(text or '').rstrip()}\n\n\b\nExamples:\n{lines}"


def add_examples(app, prefix: str = "") -> None:
    """Every command of `app` and its sub-apps (typer's registered commands and groups); a sub-app's
    commands are keyed by their whole name ("config cp")."""
    for info in app.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        info.help = with_examples(prefix + name, info.help or info.callback.__doc__)
    for group in app.registered_groups:
        group.help = with_examples(prefix + group.name, group.help or group.typer_instance.info.help)
        add_examples(group.typer_instance, f"{prefix}{group.name} ")
