#!/usr/bin/env python3
# qmp.py SOCK 'json-cmd' ['json-cmd' ...] ; special: "wait" polls query-migrate until done
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile('rw')
def rd():
    while True:
        m = json.loads(f.readline())
        if 'event' not in m: return m
rd(); f.write('{"execute":"qmp_capabilities"}\n'); f.flush(); rd()
def ex(c):
    f.write(c + '\n'); f.flush(); return rd()
for c in sys.argv[2:]:
    t = time.time()
    if c == 'wait':
        while True:
            r = ex('{"execute":"query-migrate"}')['return']
            if r.get('status') in ('completed', 'failed', 'cancelled'): break
            time.sleep(0.005)
        print('wait', round((time.time()-t)*1000), 'ms', json.dumps({k: r.get(k) for k in ('status','error-desc','total-time','ram')}))
    else:
        print(round((time.time()-t)*1000), 'ms', c[:80], '->', json.dumps(ex(c))[:600])
