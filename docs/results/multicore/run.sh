#!/usr/bin/env bash
# The multi-core checks (issue 34, item 5; the CUDA tests): run once on a lent 16-core GPU
# machine, from the repository root, as `bash docs/results/multicore/run.sh OUTDIR [SCALE]`.
# It builds the C data plane in place (no pip install: that machine has no registry), then runs
# the groups named in GROUPS (default all but "smoke", CI's: cuda calibrate threads threads9000
# fastpath window gloo testbed):
#   1. the CUDA tests (tests/torch/test_cuda.py, the FSDP tests, which run FSDP1 on a GPU);
#   2. `switchml calibrate` and `switchml plan` from that machine's costs;
#   3. one rank through a 4-shard switch on loopback at T = 1, 2, 4, 8 threads (and T = 8
#      through 1 shard: the switch's core binding), the job's default window shared by T;
#      ("threads9000") the same at MTU 9000; ("fastpath") T = 1, 2, 4 through one shard, where
#      the worker's compiled loop runs (it needs one switch address); ("window") with 16 slots per thread (64 KB
#      datagrams) and 29 (MTU 9000), whatever the job's default;
#   4. 4 ranks against gloo on loopback, T = 1 and 2, through 1 and 4 shards;
#   5. where ip, tc and nft exist: the testbed, 2 workers at 10 Gbit/s, MTU 9000, T = 1 and 2.
# Every step is bounded by `timeout`; OUTDIR/multicore.tgz is rewritten after each one, so a
# run stopped early still returns what it measured. SCALE=small runs tiny sizes (a dry run).
set -u
out=${1:?OUTDIR}; scale=${2:-full}; groups=" ${3:-cuda calibrate threads threads9000 fastpath window gloo testbed} "
on() { [[ "$groups" == *" $1 "* ]]; }
r=/tmp/multicore; rm -rf "$r"; mkdir -p "$r"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
snap() { tar czf "$out/multicore.tgz" -C "$r" . 2>/dev/null; }
step() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$r/$name.log" 2>&1; local rc=$?
  echo "   rc=$rc in $(( $(date +%s) - t0 )) s"; tail -n 25 "$r/$name.log"; snap; }
if [ "$scale" = small ]; then big=16MiB; mid=4MiB; iters=2; else big=256MiB; mid=64MiB; iters=6; fi
{ nproc; python3 -V; python3 -c "import torch, numpy, ml_dtypes; print('torch', torch.__version__, torch.cuda.is_available(), 'numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__)"
  nvidia-smi -L 2>/dev/null; grep -m1 "model name" /proc/cpuinfo; uptime
  for t in ip tc nft ethtool gcc; do echo "$t: $(command -v $t || echo missing)"; done
} > "$r/machine.txt" 2>&1
cat "$r/machine.txt"
step build 120 python3 setup.py build_ext --inplace -q
on cuda && step cuda-tests 300 python3 -m pytest -q -p no:cacheprovider -m "" -x \
  tests/torch/test_cuda.py tests/torch/test_torch_fsdp.py
on calibrate && step calibrate 120 python3 -m switchml calibrate --out "$r/calibration.json"
on calibrate && step plan 120 python3 -m switchml plan --workers 8 --calibration "$r/calibration.json" \
  --json "$r/plan-n8.json"
for t in 1 2 4 8; do on threads || break
  step "loopback-n1-T$t-S4" 120 python3 -m switchml bench allreduce -n 1 --size $big \
    --iters $iters --no-gloo --threads $t --shards 4 --json "$r/loopback-n1-T$t-S4.json"
done
on threads && step loopback-n1-T8-S1 120 python3 -m switchml bench allreduce -n 1 --size $big \
  --iters $iters --no-gloo --threads 8 --json "$r/loopback-n1-T8-S1.json"
for t in 1 2 4 8; do on threads9000 || break
  step "loopback-n1-mtu9000-T$t-S4" 120 python3 -m switchml bench allreduce -n 1 --size $big \
    --iters $iters --no-gloo --threads $t --shards 4 --mtu 9000 \
    --json "$r/loopback-n1-mtu9000-T$t-S4.json"
done
for mtu in 65536 9000; do on fastpath || break  # one shard: the worker's compiled loop runs
  for t in 1 2 4; do
    step "loopback-n1-mtu$mtu-T$t-S1" 120 python3 -m switchml bench allreduce -n 1 --size $big \
      --iters $iters --no-gloo --threads $t --mtu $mtu --json "$r/loopback-n1-mtu$mtu-T$t-S1.json"
  done
done
for mw in "65536 16" "9000 29"; do on window || break; set -- $mw
  for t in 1 2 4 8; do
    step "loopback-n1-mtu$1-T$t-W$(( $2 * t ))-S4" 120 python3 -m switchml bench allreduce -n 1 \
      --size $big --iters $iters --no-gloo --threads $t --shards 4 --mtu $1 \
      --window $(( $2 * t )) --json "$r/loopback-n1-mtu$1-T$t-W$(( $2 * t ))-S4.json"
  done
done
for ts in "1 1" "1 4" "2 4"; do on gloo || break; set -- $ts
  step "loopback-n4-T$1-S$2" 180 python3 -m switchml bench allreduce -n 4 --size $mid \
    --iters $iters --threads $1 --shards $2 --json "$r/loopback-n4-T$1-S$2.json"
done
for t in 1 2; do on smoke || break  # (CI runs this group, small, so that the script keeps working)
  step "smoke-T$t-S2" 60 python3 -m switchml bench allreduce -n 1 --size $mid --iters 1 \
    --warmup 1 --no-gloo --threads $t --shards 2 --json "$r/smoke-T$t-S2.json"
done
# 5. Where the machine has the testbed's tools: two workers at 10 Gbit/s, MTU 9000, T = 1 and 2.
if on testbed && [ "$(id -u)" = 0 ] && command -v ip && command -v tc && command -v nft; then
  for t in 1 2; do
    step "testbed-n2-10gbit-mtu9000-T$t" 200 python3 -m switchml bench allreduce --testbed -n 2 \
      --rate-mbit 10000 --mtu 9000 --size $mid --iters $iters --systems switchml,gloo \
      --threads $t --json "$r/testbed-n2-10gbit-mtu9000-T$t.json"
  done
fi
echo "== done"; snap
