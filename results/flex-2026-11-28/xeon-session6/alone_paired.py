import json,sys,statistics as st,math
d,a,b,n=sys.argv[1],sys.argv[2],sys.argv[3],int(sys.argv[4])
T={2:12.706,3:4.303,4:3.182,5:2.776,6:2.571,7:2.447,8:2.365}
def load(p):
    o={}
    for l in open(p):
        if l.startswith('{'):
            j=json.loads(l)
            if j['workload'].startswith('connectivity'): o[j['variant']]=(j['ms'],j['cpu_ms'])
    return o
R={x:[load(f"{d}/{x}-{i}.log") for i in range(1,n+1)] for x in (a,b)}
for v in ['residual','attnres','block_attnres']:
    xa=[r[v][0] for r in R[a]]; xb=[r[v][0] for r in R[b]]
    ca=[r[v][1] for r in R[a]]; cb=[r[v][1] for r in R[b]]
    dd=[y-x for x,y in zip(xa,xb)]; m=st.mean(dd); h=T[n]*st.stdev(dd)/math.sqrt(n)
    dc=[y-x for x,y in zip(ca,cb)]; mc=st.mean(dc); hc=T[n]*st.stdev(dc)/math.sqrt(n)
    print(f"{v:14s} {a} {' '.join(f'{x:.1f}' for x in xa)} | {b} {' '.join(f'{x:.1f}' for x in xb)} | diff {m:+.2f} [{m-h:+.2f}, {m+h:+.2f}] ms | cpu diff {mc:+.2f} [{mc-hc:+.2f}, {mc+hc:+.2f}] ms")
