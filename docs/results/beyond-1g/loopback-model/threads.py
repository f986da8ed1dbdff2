import os,time,sys
def snap():
    d={}
    for p in os.listdir('/proc'):
        if not p.isdigit(): continue
        try:
            for t in os.listdir(f'/proc/{p}/task'):
                ns=int(open(f'/proc/{p}/task/{t}/schedstat').read().split()[0])
                name=open(f'/proc/{p}/task/{t}/comm').read().strip()
                d[(p,t)]=(ns,name)
        except Exception: pass
    return d
def stat():
    f=list(map(int,open('/proc/stat').readline().split()[1:])); return f
a=snap(); s0=stat(); t0=time.time(); time.sleep(float(sys.argv[1])); b=snap(); s1=stat(); dt=time.time()-t0
df=[x-y for x,y in zip(s1,s0)]; tot=sum(df)
names="user nice system idle iowait irq softirq steal".split()
print("machine: "+" ".join(f"{n}={100*2*v/tot:.0f}" for n,v in zip(names,df)), "busy", f"{200*(tot-df[3]-df[4])/tot:.0f}%")
rows=sorted(((b[k][0]-a[k][0],k) for k in b if k in a),reverse=True)[:int(sys.argv[2]) if len(sys.argv)>2 else 8]
for v,k in rows: print(f"{v/dt/1e7:6.1f}% {k} {b[k][1]}")
print(f"sum of tasks {sum(b[k][0]-a[k][0] for k in b if k in a)/dt/1e7:.0f}%")
