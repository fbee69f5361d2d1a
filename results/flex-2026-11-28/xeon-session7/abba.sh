#!/bin/bash
# usage: abba.sh DIR NAME A B: runs A, B, B, A of the targets' command (NAME-A-1, NAME-B-1, NAME-B-2, NAME-A-2)
cd "$1"; W=$2; A=$3; B=$4
CMD="--only stack --passes train-step --runs 28 --warmup 2 --depths 12 --variants laurel,mhc_lite,attnres,block_attnres,mudd,mhc_v4"
run() {
  echo "$W-$1-$2 start $(date -u +%H:%M:%S)" >> times.txt
  /tmp/bins/$1 $CMD > $W-$1-$2.log 2> $W-$1-$2.err
  echo "$W-$1-$2 end $(date -u +%H:%M:%S)" >> times.txt
}
run $A 1; run $B 1; run $B 2; run $A 2
