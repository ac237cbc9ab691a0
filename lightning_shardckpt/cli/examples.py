"""Examples at the end of a command's `--help`, on the main job's root: `./scripts/run_train.sh` writes
checkpoints/tinylm and keeps steps 20, 30 and 40. Each line runs as printed from the repository root once
that job ran, with the environment's bin/ on PATH (`. .venv/bin/activate`); tests/unit/test_cli_help.py
runs every one. (`export` keeps its own examples in its --help: they need a bucket.)"""

ROOT = "checkpoints/tinylm"

EXAMPLES = {
    "ls": [f"shardckpt ls {ROOT}", f"shardckpt ls {ROOT} --json"],
    "inspect": [f"shardckpt inspect {ROOT}/latest"],
    "verify": [f"shardckpt verify {ROOT}/latest", f"shardckpt verify {ROOT} --json"],
    "diff": [f"shardckpt diff --root {ROOT} 30 40"],
    "timeline": [f"shardckpt timeline {ROOT}", f"shardckpt timeline {ROOT} --metric train/loss"],
    "gc": [f"shardckpt gc {ROOT}"],
    "drill": [f"shardckpt drill {ROOT}", f"shardckpt drill {ROOT} --world-size 3 --json"],
    "last-good": [f"shardckpt last-good {ROOT}"],
    "health": [f"shardckpt health {ROOT} --rules conf/health/default.yaml --plot health.png"],
    "bisect": [f"shardckpt bisect {ROOT} --bad nonfinite"],
    "compare": [f"shardckpt compare --root {ROOT} 30 40 --top 5"],
}


def epilog(command: str) -> str:
    lines = EXAMPLES.get(command)
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""
