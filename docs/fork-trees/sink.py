#!/usr/bin/env python3
# sink.py SOCK OUT : accept one unix connection, copy it to OUT, print bytes
import socket, sys, os
p=sys.argv[1]
try: os.unlink(p)
except FileNotFoundError: pass
s=socket.socket(socket.AF_UNIX); s.bind(p); s.listen(1); c,_=s.accept(); n=0
with open(sys.argv[2],'wb') as o:
    while True:
        b=c.recv(1<<20)
        if not b: break
        o.write(b); n+=len(b)
print(p,'bytes',n)
