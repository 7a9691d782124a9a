#!/usr/bin/env bash
# Multilevel pretraining (V-, W- and F-cycles, growth) with Megatron-Core and DeepSpeed.
#
#   launch/pretrain_vcycle.sh [CONFIG.json] [dotted.key=value ...] [launcher options]
#
# With no CONFIG, runs the embedded default, configs/gpt_tiny_cpu.json: a small GPT F-cycle (the recipe) on
# the Python standard library's sources, then its baseline and its control: three runs, about five minutes
# on a 2-core CPU. Overrides change the config; training.steps_scale=0.1 runs a tenth of every phase, e.g.
#   launch/pretrain_vcycle.sh configs/gpt_tiny_cpu.json training.steps_scale=0.1 training.output_dir=runs/try
#
# --with-baseline also trains the fine model from scratch with the run's training FLOPs (in <run>/baseline,
# reused when finished) and its control, the coarse model alone (<run>/control), and reports the saving at
# equal quality; on by default for configs/gpt_tiny_cpu.json only; --no-baseline skips both, --no-control the control.
# --allow-config-change resumes a run although its config changes what its checkpoint's said (rates,
# seed, data...), recorded in <run>/config_changes.jsonl; without it such a resume is refused.
#
# SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) to any process of the run: every rank finishes
# its step, the run saves a checkpoint and exits with status 75; the same command resumes it. A
# second signal exits at once (the last complete checkpoint kept); training.stop_grace_seconds bounds
# the clean stop. A run holds <output_dir>/run.lock: a second run on the same directory is refused.
#
# --wandb-project NAME [--wandb-group GROUP]: the metrics to Weights & Biases too (the config's DeepSpeed
# "wandb" block; WANDB_MODE=offline works offline); "csv_monitor" in the config adds CSV files.
#
# Launcher options go to the DeepSpeed launcher as DeepSpeed users expect:
#   --num_gpus N (alias --num_procs N: processes per node; on CPU one process by default)
#   --num_nodes N, --hostfile FILE, --master_addr ADDR, --master_port PORT,
#   --include/--exclude SPEC, --no_ssh --node_rank R (start each node yourself), --bind_cores_to_rank
#   --launcher-log-level LEVEL: the launcher's own log lines (default warning: its INFO lines off;
#   info shows them)
# e.g. on two nodes:
#   launch/pretrain_vcycle.sh configs/gpt_base.json --hostfile hosts --num_nodes 2 --num_gpus 8
# or, without ssh, on every node:
#   launch/pretrain_vcycle.sh configs/gpt_base.json --hostfile hosts --no_ssh --node_rank $RANK \
#       --master_addr node0 --master_port 29500
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config=""
launcher=()
module_args=()
overrides=()
procs_given=0
launcher_log_level=warning
multi_node=0
port_given=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --num_procs) launcher+=(--num_gpus "$2"); procs_given=1; shift 2 ;;
    --num_procs=*) launcher+=("--num_gpus=${1#*=}"); procs_given=1; shift ;;
    --num_gpus|--include|--exclude) launcher+=("$1" "$2"); procs_given=1; shift 2 ;;
    --num_gpus=*|--include=*|--exclude=*) launcher+=("$1"); procs_given=1; shift ;;
    -H|--hostfile|--num_nodes|--node_rank) launcher+=("$1" "$2"); multi_node=1; shift 2 ;;
    --hostfile=*|--num_nodes=*|--node_rank=*) launcher+=("$1"); multi_node=1; shift ;;
    --master_port) launcher+=("$1" "$2"); port_given=1; shift 2 ;;
    --master_port=*) launcher+=("$1"); port_given=1; shift ;;
    --master_addr|--launcher|--launcher_args|--ssh_port|--bind_core_list) launcher+=("$1" "$2"); shift 2 ;;
    --master_addr=*|--launcher=*|--ssh_port=*|--bind_core_list=*) launcher+=("$1"); shift ;;
    --no_ssh|--no_ssh_check|--force_multi|--bind_cores_to_rank|--enable_each_rank_log)
      launcher+=("$1"); shift ;;
    --launcher-log-level) launcher_log_level="$2"; shift 2 ;;
    --launcher-log-level=*) launcher_log_level="${1#*=}"; shift ;;
    --with-baseline|--no-baseline|--no-control|--allow-config-change) module_args+=("$1"); shift ;;
    --wandb-project) overrides+=("wandb.enabled=true" "wandb.project=$2"); shift 2 ;;
    --wandb-project=*) overrides+=("wandb.enabled=true" "wandb.project=${1#*=}"); shift ;;
    --wandb-group) overrides+=("wandb.group=$2"); shift 2 ;;
    --wandb-group=*) overrides+=("wandb.group=${1#*=}"); shift ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    -*) echo "pretrain_vcycle.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *.json)
      if [[ -n "$config" ]]; then echo "pretrain_vcycle.sh: two configs given: $config and $1" >&2; exit 2; fi
      config="$1"; shift ;;
    *=*) overrides+=("$1"); shift ;;
    *) echo "pretrain_vcycle.sh: $1 is neither a .json config nor a dotted.key=value override" >&2; exit 2 ;;
  esac
done

case "$launcher_log_level" in
  debug|info|warning|error) ;;
  *) echo "pretrain_vcycle.sh: invalid --launcher-log-level $launcher_log_level; valid choices are debug, info, warning, error" >&2
     exit 2 ;;
esac
launcher+=(--log_level "$launcher_log_level")
if [[ -z "$config" ]]; then
  config="$root/configs/gpt_tiny_cpu.json"
fi
if [[ ! -f "$config" ]]; then
  echo "pretrain_vcycle.sh: config $config does not exist" >&2; exit 2
fi

python_bin="${PYTHON:-python}"
if ! "$python_bin" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)" 2>/dev/null
then
  found="cannot import deepspeed"
  command -v "$python_bin" >/dev/null || found="is not found"
  echo "pretrain_vcycle.sh: '$python_bin' $found: activate the project's environment (source .venv/bin/activate)," \
       "create it first if needed (make setup), or name another python with PYTHON=..." >&2
  exit 2
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# The config and its overrides, checked as the ranks will check them, before anything is spawned.
"$python_bin" -m megatron_multilevel.pretrain --check --config "$config" "${module_args[@]}" "${overrides[@]}" || exit $?
# It has shown the config's warnings; the ranks, checking the same config, do not repeat them.
export PYTHONWARNINGS="ignore::UserWarning:megatron_multilevel.config.run${PYTHONWARNINGS:+,$PYTHONWARNINGS}"

if ! "$python_bin" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # CPU: one process unless asked otherwise (the DeepSpeed launcher would start one per NUMA node).
  if [[ $procs_given -eq 0 ]]; then launcher+=(--num_gpus 1); fi
  # named, so that DeepSpeed does not warn on every rank that it found no GPU
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
if [[ $multi_node -eq 0 && $port_given -eq 0 ]]; then
  # One node: a free port, so that several runs on one machine do not collide on 29500. Drawn below
  # the kernel's ephemeral range (32768 and up): a port from that range can be taken, between this
  # check and the rendezvous, by any outgoing connection of another run (gloo opens many).
  launcher+=(--master_port "$("$python_bin" -c '
import random, socket
for port in random.sample(range(20000, 32768), 200):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    print(port)
    break
else:
    raise SystemExit("pretrain_vcycle.sh: no free port in 20000-32767; pass --master_port")')")
fi
# DeepSpeed compiles small ops at run time; keep them in one place so that every run pays once.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}"

# DeepSpeed's runner and node launch, with signals forwarded to every rank (a stopped run saves and
# exits with 75: run the same command to resume), no process outliving the launcher, and overrides
# quoted for pdsh's remote shell: megatron_multilevel/launching/.
exec "$python_bin" -m megatron_multilevel.launching.runner "${launcher[@]}" --module megatron_multilevel.pretrain \
  --config "$config" "${module_args[@]}" "${overrides[@]}"
