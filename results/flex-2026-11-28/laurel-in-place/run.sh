#!/bin/bash
cd /tmp/ab
for i in 1 2 3 4 5 6 7 8; do
  if [ $((i % 2)) -eq 1 ]; then order="base after"; else order="after base"; fi
  for b in $order; do
    /tmp/bench_$b --only stack --passes train-step --runs 16 --warmup 2 --depths 12 --variants laurel > $b-$i.jsonl 2> $b-$i.log || echo "fail $b $i" >> runs.txt
    echo "$b $i $(date +%T)" >> runs.txt
  done
done
echo done >> runs.txt
