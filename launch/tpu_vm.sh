#!/usr/bin/env bash
# Train on a Cloud TPU VM slice (every host of a pod runs the same command; JAX finds the pod).
#
#   launch/tpu_vm.sh TPU_NAME ZONE WORKDIR [--config.a.b=value ...]
#   launch/tpu_vm.sh valen-v5p-32 us-east5-a /mnt/valen/runs/vflash-v5p --config.data.train=/mnt/valen/shards/vflash --config.data.eval=/mnt/valen/shards/vflash_eval
#
# Expects: the slice exists (gcloud compute tpus tpu-vm create ... --version=<a TPU VM base image>),
# this repository is checked out at ~/valen-jax on every host (REPO to change that), and WORKDIR
# is one directory all hosts share, e.g. a GCS bucket mounted with gcsfuse on every host: Orbax
# writes each host's shards of the state there, and train.py keeps metrics, tokenizer and shards
# under the same path. CONFIG picks the config (default configs/vflash.py). Not run from here.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  sed -n '2,5p' "$0" >&2
  exit 2
fi
TPU_NAME=$1 ZONE=$2 WORKDIR=$3
shift 3
REPO=${REPO:-valen-jax}  # relative to the remote home, where ssh starts
CONFIG=${CONFIG:-configs/vflash.py}
# Quoted once here, so each override reaches the remote shell as one word.
OVERRIDES=$(printf ' %q' "$@")

# make setup installs the CPU jaxlib of the lock; libtpu comes with jax's `tpu` extra of the
# same version. valen_jax.cli.distributed detects the pod (JAX's Cloud TPU cluster detection reads
# the worker list from the VM metadata) and calls jax.distributed.initialize() on every host.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  set -euo pipefail
  cd $REPO
  make setup
  .venv/bin/pip install --quiet \"jax[tpu]==\$(.venv/bin/python -c 'import jax; print(jax.__version__)')\"
  .venv/bin/python -m valen_jax.train --config=$CONFIG --workdir=$WORKDIR$OVERRIDES
"
