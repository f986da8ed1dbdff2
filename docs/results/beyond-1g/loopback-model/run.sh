set -e
for p in 1 2 3; do
  for T in 1 2; do switchml bench allreduce -n 1 --size 256MiB --iters 12 --no-gloo --threads $T --json n1-T$T-pass$p.json > /dev/null 2>&1; done
done
for p in 1 2; do
  for n in 2 4; do switchml bench allreduce -n $n --size 64MiB --iters 30 --warmup 1 --json n$n-pass$p.json > /dev/null 2>&1; done
done
echo done
