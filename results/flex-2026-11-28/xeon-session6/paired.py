#!/usr/bin/env python3
"""usage: paired.py DIR A B N  -- per variant: ratio to residual per run, paired diffs (B-A), t 95%."""
import json, sys, statistics as st, math
d, a, b, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def load(path):
    out = {}
    for line in open(path):
        line=line.strip()
        if line.startswith('{'):
            j = json.loads(line); out[j['variant']] = (j['ms'], j.get('host_peak_mb'))
    return out
T = {2:12.706,3:4.303,4:3.182,5:2.776,6:2.571,8:2.365}
runs = {x:[load(f"{d}/{x}-{i}.log") for i in range(1,n+1)] for x in (a,b)}
variants = [v for v in runs[a][0] if v != 'residual']
def ci(xs):
    m = st.mean(xs)
    if len(xs) < 2: return m, float('nan'), float('nan')
    h = T.get(len(xs), 2.0) * st.stdev(xs)/math.sqrt(len(xs)); return m, m-h, m+h
print(f"residual ms {a}: {[round(r['residual'][0],1) for r in runs[a]]} {b}: {[round(r['residual'][0],1) for r in runs[b]]}")
for v in variants:
    ra = [r[v][0]/r['residual'][0] for r in runs[a]]; rb = [r[v][0]/r['residual'][0] for r in runs[b]]
    ea = [r[v][0]-r['residual'][0] for r in runs[a]]; eb = [r[v][0]-r['residual'][0] for r in runs[b]]
    dr = ci([y-x for x,y in zip(ra,rb)]); de = ci([y-x for x,y in zip(ea,eb)])
    pk = [r[v][1] for r in runs[a]], [r[v][1] for r in runs[b]]
    print(f"{v:14s} {a} {' '.join(f'{x:.3f}' for x in ra)} | {b} {' '.join(f'{x:.3f}' for x in rb)} | ratio diff {dr[0]:+.3f} [{dr[1]:+.3f}, {dr[2]:+.3f}] | excess diff {de[0]:+.1f} ms [{de[1]:+.1f}, {de[2]:+.1f}] | peak MB {pk[0][0]} -> {pk[1][0]}")
