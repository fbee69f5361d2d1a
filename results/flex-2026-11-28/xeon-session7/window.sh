#!/bin/bash
# usage: window.sh DIR NAME BIN RUNS
cd "$1"; W=$2; BIN=$3; N=$4
CMD="--only stack --passes train-step --runs 28 --warmup 2 --depths 12 --variants laurel,mhc_lite,attnres,block_attnres,mudd,mhc_v4"
for i in $(seq 1 $N); do
  echo "$W-$i start $(date -u +%H:%M:%S)" >> times.txt
  /tmp/bins/$BIN $CMD > $W-$i.log 2> $W-$i.err
  echo "$W-$i end $(date -u +%H:%M:%S)" >> times.txt
done
