#!/bin/bash
# usage: ab.sh DIR A B PAIRS
cd "$1"; A=$2; B=$3; N=$4
CMD="--only stack --passes train-step --runs 28 --warmup 2 --depths 12 --variants laurel,mhc_lite,attnres,block_attnres,mudd,mhc_v4"
for i in $(seq 1 $N); do
  if [ $((i % 2)) -eq 1 ]; then order="$A $B"; else order="$B $A"; fi
  for b in $order; do
    echo "$b-$i start $(date -u +%H:%M:%S)" >> times.txt
    /tmp/bins/$b $CMD > $b-$i.log 2> $b-$i.err
    echo "$b-$i end $(date -u +%H:%M:%S)" >> times.txt
  done
done
