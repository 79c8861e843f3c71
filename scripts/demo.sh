#!/usr/bin/env bash
# The main job on the embedded default: format an emulated zoned image, mount it, run a small
# training job that checkpoints with latest-K retention onto it, show status, unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${RETAINZFS_DEMO_DIR:-/var/tmp/retainzfs-demo}
STEPS=${STEPS:-300}
mkdir -p "$WORK/mnt"
mountpoint -q "$WORK/mnt" && umount "$WORK/mnt"
mkfs.retainzfs --force --size 1G --zone-size 4M --max-open 8 --max-active 8 "$WORK/ckpt.zns"
mount.retainzfs "$WORK/ckpt.zns" "$WORK/mnt"
trap 'umount "$WORK/mnt" 2>/dev/null || true' EXIT
python3 scripts/train_demo.py --dir "$WORK/mnt/run" --steps "$STEPS" --every 10 --keep 3
retainzfs status "$WORK/mnt"
