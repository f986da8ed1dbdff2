import numpy as np, time, sys
a=np.ones(1<<22, dtype=np.float32); b=np.empty_like(a)
x=bytearray(64<<10)
def t(f,n):
    t0=time.process_time(); f(n); return time.process_time()-t0
def numpy_loop(n):
    for _ in range(n): np.multiply(a, 1.5, out=b)
def py_loop(n):
    s=0
    for i in range(n*20000): s+=i
for i in range(int(sys.argv[1])):
    print(f"numpy {t(numpy_loop,200):.3f}s  python {t(py_loop,100):.3f}s", flush=True); time.sleep(0.5)
